"""Synthetic talking-face data for the trained demonstrator.

Speech with phoneme timings (`speech` over `espeak`: espeak-ng, the optional `train` extra,
GPL-3), phoneme -> mouth tracks (`visemes`), a parametric cartoon face (`identity`,
`motion`, `face`), clips and their splits (`text`, `splits`, `clips`) and npz shards
(`shards`). Nothing here is imported by the serving path; only `espeak` loads espeak-ng,
and only the renderer (`face`) imports jax.
"""
