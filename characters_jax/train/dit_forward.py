"""The DiT's training forward: one clip as the engine would generate it, every step at once.

The engine (`characters_jax.engine.step`) generates a session step by step: the sink
(reference image latent + prompt tokens, padded to a prompt bucket, the padding masked) is
prefilled at sigma 0; step s denoises one latent frame with its audio tokens in
`num_passes` Euler passes, each block writing the frame's K/V into the ring and attending
over the sink, the previous `ring_frames - 1` frames' K/V (as the last pass, at sigma 0.25,
left them) and the frame itself. `clip_velocity` computes, for all L steps of a clip at
once, the velocity the engine's model would output at step s for a current frame
`cur_latent[s]` at noise level `cur_sigma[s]`, given that the earlier steps' last-pass
inputs were `ctx_latent[:s]` (at sigma 0.25; in training the ground truth noised to 0.25):

  per block (the model's `Block` as it is, three calls, each with its own attention
  function, `FunctionOps`):
    sink     [S, d] at sigma 0: attends the sink (prompt padding masked);
    context  [L * T, d] at sigma 0.25: frame j attends the sink and context frames
             max(0, j - R + 1) .. j (R = ring_frames): the K/V the ring holds for frame j;
    current  [L, T, d] at sigma cur_sigma[s] (one block call per frame, vmapped): frame s
             attends the sink, context frames max(0, s - R + 1) .. s - 1 and itself.

Positions are the engine's (`frame_positions` at the frame time the step assigns: 1, 2, ...,
and `reset_period` back every `reset_period` steps once the ring is full). RoPE is
relative, so attention between frames depends on their step distance only (the engine's
delta rotation at a reset keeps it), and attention to the sink (time 0) on the frame's own
time: a query is rotated by its wrapped time for the sink's keys and by its step index for
the frames' keys, exactly the angles the engine's rotated cache gives.

Shapes: T_img = grid_h * grid_w image tokens and A audio tokens per frame (T = T_img + A);
C latent channels; F audio features; P prompt bucket. Everything float32 here (the config's
activation dtype is used by the model's own layers).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from characters_jax.config import Config
from characters_jax.engine.state import frame_positions, sink_positions
from characters_jax.model.dit import DiT, FunctionOps, scan_blocks

from characters_jax.model.rope import rope_angles, rope_frequencies, rotate

CONTEXT_SIGMA = 0.25  # the sigma of the last pass, whose K/V a frame leaves in the ring


def frame_times(steps: int, ring_frames: int, reset_period: int) -> np.ndarray:
    """int32 [steps]: the time position the engine gives step s's frame (the session starts
    at 1; when it reaches ring_frames + reset_period it moves back by reset_period)."""
    out = np.zeros(steps, np.int32)
    t = 1
    for s in range(steps):
        if t >= ring_frames + reset_period:
            t -= reset_period
        out[s] = t
        t += 1
    return out


def _attention(q_sink, q_frames, k_sink, v_sink, sink_valid, k_frames, v_frames, frames_valid):
    """Softmax attention of queries over two key sets, as `attention_reference` computes it
    (float32, scale 1/sqrt(D), masked slots -inf): q_* [Tq, H, D] (rotated for each key
    set), k_*/v_* [S*, H, D], *_valid [S*] bool -> [Tq, H, D]."""
    d = q_sink.shape[-1]
    hi = lax.Precision.HIGHEST
    f32 = jnp.float32
    s1 = jnp.einsum("qhd,khd->hqk", q_sink.astype(f32), k_sink.astype(f32), precision=hi)
    s2 = jnp.einsum("qhd,khd->hqk", q_frames.astype(f32), k_frames.astype(f32), precision=hi)
    s = jnp.concatenate([s1, s2], axis=-1) * (1.0 / math.sqrt(d))
    valid = jnp.concatenate([sink_valid, frames_valid])
    s = jnp.where(valid[None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    v = jnp.concatenate([v_sink, v_frames], axis=0).astype(f32)
    o = jnp.einsum("hqk,khd->qhd", p / jnp.maximum(l, 1e-30), v, precision=hi)
    return o.astype(q_sink.dtype)


def _reduce(pairs):
    """The block's row-parallel sum at tp = 1: sum of x @ w.T in float32, rounded once."""
    out = None
    for x, w in pairs:
        y = lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        out = y if out is None else out + y
    return out.astype(pairs[0][0].dtype)


def clip_velocity(model: DiT, cfg: Config, sink_latent, prompt, prompt_len, ctx_latent, audio, cur_latent, cur_sigma,
                  ctx_sigma: float = CONTEXT_SIGMA):
    """Velocities of one clip's L steps (module docstring).

    sink_latent [T_img, C]; prompt [P] int32 (padded); prompt_len [] int32; ctx_latent
    [L, T_img, C] (step s's last-pass input, at ctx_sigma); audio [L, A, F]; cur_latent
    [L, T_img, C] at cur_sigma [L] float32. Returns [L, T_img, C] float32.
    """
    v, m, c = cfg.video, cfg.model, cfg.cache
    gh, gw, t_img, a_tok = v.grid_h, v.grid_w, v.tokens_per_frame, m.audio_tokens_per_step
    steps, r = ctx_latent.shape[0], c.ring_frames
    t = t_img + a_tok
    p = prompt.shape[0]
    freqs = rope_frequencies(m.head_dim, m.rope_split, m.rope_theta)

    rope_sink = rope_angles(sink_positions(gh, gw, p), freqs)
    sink_valid = jnp.concatenate([jnp.ones((t_img,), bool), jnp.arange(p) < prompt_len])
    wrapped = jnp.asarray(frame_times(steps, r, c.reset_period))
    unwrapped = jnp.arange(1, steps + 1, dtype=jnp.int32)

    def ropes(times):
        pos = jax.vmap(lambda ft: frame_positions(ft, gh, gw, a_tok))(times).reshape(steps * t, 3)
        cos, sin = rope_angles(pos, freqs)
        return cos.reshape(steps, t, -1), sin.reshape(steps, t, -1)

    rope_w, rope_u = ropes(wrapped), ropes(unwrapped)
    # window slot i of frame j is context frame j - (r - 1) + i; frames before 0 are masked
    window_valid = (jnp.arange(steps)[:, None] - (r - 1) + jnp.arange(r)[None, :]) >= 0  # [L, r]

    def at(rope, j):
        return rope[0][j], rope[1][j]

    x_sink = model.embed_sink(sink_latent, prompt)
    x_ctx = jax.vmap(model.embed_frame)(ctx_latent, audio)  # [L, T, d]
    x_cur = jax.vmap(model.embed_frame)(cur_latent, audio)
    mod_sink = model.shared_modulation(model.time_embedding(jnp.float32(0.0)))
    mod_ctx = model.shared_modulation(model.time_embedding(jnp.float32(ctx_sigma)))
    temb_cur = jax.vmap(model.time_embedding)(cur_sigma.astype(jnp.float32))  # [L, d]
    mod_cur = jax.vmap(model.shared_modulation)(temb_cur)  # [L, 3, d]

    def block_fn(block, layer, x_sink, mod_sink, carry):
        x_ctx, x_cur = carry

        def attend_sink(q, k, v_):
            kr, qr = rotate(k, rope_sink), rotate(q, rope_sink)
            empty = jnp.zeros((0,) + k.shape[1:], k.dtype)
            o = _attention(qr, qr, kr, v_, sink_valid, empty, empty, jnp.zeros((0,), bool))
            return o, (kr, v_)

        x_sink, (k_sink, v_sink) = block(x_sink, mod_sink, FunctionOps(attend_sink, _reduce))
        heads, hd = k_sink.shape[1], k_sink.shape[2]

        def windows(x):
            """[L, T, H, D] -> frame j's ring window [L, r * T, H, D] (zeros before frame 0)."""
            padded = jnp.concatenate([jnp.zeros((r - 1,) + x.shape[1:], x.dtype), x])
            idx = jnp.arange(steps)[:, None] + jnp.arange(r)[None, :]
            return padded[idx].reshape(steps, r * t, heads, hd)

        def attend_ctx(q, k, v_):
            q, k, v_ = (a.reshape(steps, t, heads, hd) for a in (q, k, v_))
            ku = jax.vmap(rotate)(k, rope_u)
            qw, qu = jax.vmap(rotate)(q, rope_w), jax.vmap(rotate)(q, rope_u)
            kwin, vwin = windows(ku), windows(v_)
            valid = jnp.repeat(window_valid, t, axis=1)  # [L, r * T]
            o = jax.vmap(lambda a, b, kk, vv, ok: _attention(a, b, k_sink, v_sink, sink_valid, kk, vv, ok))(
                qw, qu, kwin, vwin, valid)
            return o.reshape(steps * t, heads, hd), (ku, v_)

        x_flat, (k_ctx, v_ctx) = block(x_ctx.reshape(steps * t, -1), mod_ctx, FunctionOps(attend_ctx, _reduce))
        x_ctx = x_flat.reshape(steps, t, -1)
        k_prev, v_prev = windows(k_ctx), windows(v_ctx)  # frame j's window; the current frame drops slot r - 1
        prev = (r - 1) * t

        def current(x_f, mod_f, j):
            def attend_cur(q, k, v_):
                ku, qu, qw = rotate(k, at(rope_u, j)), rotate(q, at(rope_u, j)), rotate(q, at(rope_w, j))
                kk = jnp.concatenate([k_prev[j, :prev], ku])
                vv = jnp.concatenate([v_prev[j, :prev], v_])
                ok = jnp.concatenate([jnp.repeat(window_valid[j, : r - 1], t), jnp.ones((t,), bool)])
                return _attention(qw, qu, k_sink, v_sink, sink_valid, kk, vv, ok), None

            return block(x_f, mod_f, FunctionOps(attend_cur, _reduce))[0]

        x_cur = jax.vmap(current)(x_cur, mod_cur, jnp.arange(steps))
        return x_sink, (x_ctx, x_cur)

    _, (_, x_cur) = scan_blocks(model.blocks, x_sink, mod_sink, (x_ctx, x_cur), block_fn)
    return jax.vmap(model.head)(x_cur[:, :t_img], temb_cur)
