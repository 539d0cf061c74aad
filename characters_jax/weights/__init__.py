"""Weights on disk: a weights directory (`directory`: the trained DiT and VAE of one config,
its manifest and checks, the bundled ones under checkpoints/), and the DiT's sharded orbax
checkpoints (`dit`: save, restore onto an engine's mesh, the DiT of a weights directory)."""
