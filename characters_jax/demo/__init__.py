"""`characters-jax demo` (run.py), its bundled inputs (assets.py, assets/), and stand-ins for
the model (fakes.py) that serve the real worker in-process for tests and client development."""
