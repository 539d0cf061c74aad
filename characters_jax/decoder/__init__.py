"""The causal VAE: video decoder with per-session temporal state, and the image encoder."""
