"""The lip-sync measure: it reads generated frames only.

`probe`: small CNNs trained on the cartoon renderer (mouth openness; identity parameters),
shipped in `weights/`; `score`: the probe's jaw track correlated with the ground-truth
track over lags (peak, lag, confidence); `identity`: which reference a clip looks like, and
how far it is from its own. Loading and scoring need jax and flax only (no espeak);
`train` and `evaluate` build on the renderer and (evaluate) the espeak-ng clips.
"""
