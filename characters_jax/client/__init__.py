"""The client library of CharacterService: CharacterClient (character_client.py), one
session's Converse stream (stream.py), targets and balancing (targets.py), the client's
credentials, its playout clock, and `characters-jax talk`."""
