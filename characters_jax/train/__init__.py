"""Training of the talking demonstrator: the video VAE and the DiT, on synthetic clips.

`characters-jax train all --settings talking --out DIR` runs every stage within one deadline
(data, VAE, latents, DiT, evaluation), checkpointing each to DIR and resuming from it; the
result is a weights directory (`characters_jax.weights.directory`) that `serve --checkpoint`
and the decoder process load. Only this package and `characters_jax.data` import the
training dependencies (optax; espeak-ng through the data package).
"""
