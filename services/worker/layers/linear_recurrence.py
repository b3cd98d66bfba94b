"""Linear recurrences over a state a request, as the hybrid models' layers run them:

    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,    o_t = S_t^T q_t

per head, S a [k_dim, v_dim] matrix in float32. Mamba2's selective state space (its B the
keys, its C the queries, dt x the values, dt A the log decay) writes the values as they
are: delta_t = v_t. Qwen3.5's Gated DeltaNet corrects them by what the state already
predicts (the delta rule): delta_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t).

A prefill runs a chunk of tokens at a time in matrix products (`chunked_recurrence`), a
step of decodes one token a request for every request at once (`recurrent_step`, index
ops only: graph-safe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.attention.metadata import AttentionMetadata

CHUNK = 64  # tokens a chunk of a prefill (matrices of CHUNK x CHUNK per head)


def linear_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, state: torch.Tensor,
                      metadata: AttentionMetadata, beta: torch.Tensor | None = None) -> torch.Tensor:
    """A step's tokens ([tokens, heads, ...] as `chunked_recurrence`'s, float32), each
    request's from its row of `state` [rows, heads, k_dim, v_dim] (`metadata.state_rows`;
    from zeros at its first token), the rows updated: the decodes (the first rows) at
    once, each prefill chunk in chunks. Returns the outputs [tokens, heads, v_dim]."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    d = metadata.num_decodes
    if d:
        out[:d] = recurrent_step(q[:d], k[:d], v[:d], decay[:d], state, *metadata.decode_states(),
                                 None if beta is None else beta[:d])
    for first, last, row, carried in metadata.prefill_states():  # one request at a time
        start = state[row] if carried else torch.zeros_like(state[row])
        out[first:last], state[row] = chunked_recurrence(q[first:last], k[first:last], v[first:last],
                                                         decay[first:last], start,
                                                         None if beta is None else beta[first:last])
    return out


def chunked_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, state: torch.Tensor,
                       beta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens: q, k [tokens, heads, k_dim], v [tokens, heads, v_dim], decay
    (log) [tokens, heads], float32, from `state` [heads, k_dim, v_dim]; with `beta`
    [tokens, heads], the delta rule. Returns the outputs [tokens, heads, v_dim] and the
    final state.

    Within a chunk, with G_t the decay summed from its start to t and S the state before it,
    the recurrence unrolls to o = exp(G) q S + M delta (M_ti = exp(G_t - G_i) q_t . k_i for
    i <= t) and S <- exp(G_last) S + (exp(G_last - G) k)^T delta. The delta rule's
    corrections are delta = U - W S, where (I + diag(beta) L) U = beta v and
    (I + diag(beta) L) W = beta exp(G) k, L_ti = exp(G_t - G_i) k_t . k_i for i < t: the
    tokens' corrections of each other (the DeltaNet papers' UT transform), one triangular
    solve for every chunk at once."""
    length = q.shape[0]
    pad = -length % CHUNK
    # Padded tokens: no decay (log 0), zero key and value (and beta): they change nothing.
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1).unflatten(1, (-1, CHUNK)) for t in (q, k, v))
    decay = F.pad(decay, (0, 0, 0, pad)).T.unflatten(1, (-1, CHUNK))  # now [heads, chunks, CHUNK, ...]
    cumulative = decay.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    gaps = (cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    if beta is None:
        u, w = v, None
    else:
        beta = F.pad(beta, (0, 0, 0, pad)).T.unflatten(1, (-1, CHUNK))
        strict = ((k @ k.transpose(-1, -2)) * gaps * beta.unsqueeze(-1)).tril(-1)
        system = torch.eye(CHUNK, device=q.device) + strict
        rhs = torch.cat((v * beta.unsqueeze(-1), k * (beta * cumulative.exp()).unsqueeze(-1)), dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, w = solved.split((v.shape[-1], k.shape[-1]), dim=-1)
    attend = (q @ k.transpose(-1, -2)) * gaps  # M, i <= t
    q_decayed = q * cumulative.exp().unsqueeze(-1)
    k_to_end = k * (cumulative[..., -1:] - cumulative).exp().unsqueeze(-1)
    chunk_decay = cumulative[..., -1].exp()[..., None, None]
    out = torch.empty_like(u)
    for c in range(q.shape[1]):
        delta = u[:, c] if w is None else u[:, c] - w[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + attend[:, c] @ delta
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ delta
    return out.flatten(1, 2)[:, :length].transpose(0, 1), state


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, recurrent_state: torch.Tensor,
                   rows: torch.Tensor, carried: torch.Tensor, beta: torch.Tensor | None = None) -> torch.Tensor:
    """One token each of `rows` requests ([requests, heads, ...] as `chunked_recurrence`'s
    per token), their states `recurrent_state[rows]` updated; a request's first token
    (`carried` false) starts from zeros. Reads the state once (queries and keys together)
    and writes it once: S~ = a S (a = exp(g), 0 for a first token), delta = v or
    beta (v - S~^T k), S' = S~ + k delta^T, o = S'^T q = S~^T q + (q . k) delta."""
    s = recurrent_state.index_select(0, rows)  # [requests, heads, k_dim, v_dim]
    s.mul_((decay.exp() * carried[:, None])[..., None, None])
    read = torch.stack((k, q), dim=-2) @ s  # [requests, heads, 2, v_dim]: S~^T k and S~^T q
    delta = v if beta is None else (v - read[..., 0, :]) * beta.unsqueeze(-1)
    s.addcmul_(k.unsqueeze(-1), delta.unsqueeze(-2))
    recurrent_state.index_copy_(0, rows, s)
    return read[..., 1, :] + (q * k).sum(-1, keepdim=True) * delta
