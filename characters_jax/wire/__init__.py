"""What both ends of the service's wire agree on: the generated messages' companions (message
size limits and keepalive, the service's names and audio format), the reference image rules,
and the files of TLS and bearer tokens. The worker (serving/), the client library (client/)
and the viewer (viewer/) import from here and never from each other."""
