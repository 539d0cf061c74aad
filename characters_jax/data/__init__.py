"""Synthetic talking-face data for the trained demonstrator.

Speech with phoneme timings (`speech`, espeak-ng: the optional `train` extra, GPL-3),
phoneme -> mouth tracks (`visemes`), a parametric cartoon face (`identity`, `motion`,
`face`), clips and their splits (`text`, `splits`, `clips`) and npz shards (`shards`).
Nothing here is imported by the serving path; only `speech` loads espeak-ng.
"""
