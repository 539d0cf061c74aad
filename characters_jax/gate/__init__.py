"""The quality gate: every arithmetic-changing variant judged against the reference path's
own run-to-run variation (`characters-jax gate`).

An autoregressive video model cannot be judged by comparing pixels after a few seconds: two
runs of the same reference path already drift apart under perturbations a deployment has
anyway (another reduction order, a one-ulp change of an input, other noise seeds). The gate
measures that variation, runs each variant on the same inputs, seeds and weights, and says
per variant whether it stays within. Exact equivalences stay unit tests
(tests/test_engine.py).

Modules: `harness` (the one harness: reference runs, variants, verdict), `metric` (the
`Metric` protocol and the per-clip score verdict), the metrics `latent_metric`,
`lipsync_metric`, `fidelity_metric`, `workloads` (a random-weights session or the trained
model's held-out clips: `clips`, `sessions`), `runs` (variants, engines, weights, the
reference plan), `distance` and `variation` (the two kinds of run-to-run band), `decode`
(frames for PSNR), `options` (the TOML tables), `report`, `commands` (the command).
"""
