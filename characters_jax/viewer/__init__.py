"""`characters-jax view`: the WebRTC gateway between a web page and a worker (gateway.py) and
its page (web/)."""
