"""Voice-agent integrations, thin adapters over the client library, each an optional extra:
`pipecat` (a Pipecat video service), `livekit` (a LiveKit avatar worker, its agent-side
session and dispatcher); `playout` is what both share (a session paced at the video's frame
rate on one clock); `client_env` makes a client-only environment for a framework whose
protobuf range excludes the worker's."""
