"""The reference attention math against torch SDPA (an implementation nobody here wrote)."""

import pytest
import torch
import torch.nn.functional as F

from unified_attn.backend import AttentionType, LayerConfig
from unified_attn.backends.reference import attend, attention_mask


def layer(hq=4, hkv=2, d=8, **kw):
    return LayerConfig("l", hq, hkv, d, scale=d**-0.5, **kw)


def sdpa(q, k, v, mask, scale, bias=None):
    """SDPA over [L, Hq, D] x [S, Hkv, D] with a boolean [L, S] mask (and float bias)."""
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.transpose(0, 1).float() for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    attn = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    if bias is not None:
        attn = attn + bias
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn, scale=scale).transpose(0, 1)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("window,chunk", [(None, None), (3, None), (None, 4)])
@pytest.mark.parametrize("first", [0, 5])
def test_masks_and_gqa_match_sdpa(hq, hkv, window, chunk, first):
    torch.manual_seed(0)
    cfg = layer(hq, hkv, sliding_window=window, chunk_size=chunk)
    q = torch.randn(6, hq, 8)
    k, v = torch.randn(first + 6, hkv, 8), torch.randn(first + 6, hkv, 8)
    mask = attention_mask(cfg, torch.arange(6) + first, torch.arange(first + 6))
    expected = sdpa(q, k, v, mask, cfg.scale)
    torch.testing.assert_close(attend(cfg, q, k, v, first), expected, atol=1e-5, rtol=1e-5)


def test_window_semantics_query_sees_itself_and_w_minus_one_earlier_keys():
    mask = attention_mask(layer(sliding_window=3), torch.tensor([5]), torch.arange(6))
    assert mask.tolist() == [[False, False, False, True, True, True]]


def test_chunked_local_sees_only_its_chunk():
    mask = attention_mask(layer(chunk_size=4), torch.tensor([5]), torch.arange(6))
    assert mask.tolist() == [[False, False, False, False, True, True]]


def test_encoder_is_bidirectional():
    cfg = layer(attn_type=AttentionType.ENCODER_ONLY)
    assert attention_mask(cfg, torch.arange(3), torch.arange(3)).all()


def test_sinks_equal_an_extra_zero_value_key_with_the_sink_logit():
    torch.manual_seed(1)
    cfg = layer(4, 2)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    sinks = torch.randn(4)
    k_ext = torch.cat([torch.zeros(1, 2, 8), k])
    v_ext = torch.cat([torch.zeros(1, 2, 8), v])
    causal = attention_mask(cfg, torch.arange(5), torch.arange(5))
    mask = torch.cat([torch.ones(5, 1, dtype=torch.bool), causal], dim=1)
    bias = torch.zeros(4, 5, 6)
    bias[:, :, 0] = sinks[:, None]
    expected = sdpa(q, k_ext, v_ext, mask, cfg.scale, bias)
    torch.testing.assert_close(attend(cfg, q, k, v, 0, sinks=sinks), expected, atol=1e-5, rtol=1e-5)


def test_soft_cap_bounds_the_logits():
    torch.manual_seed(2)
    cfg = layer(2, 2, logits_soft_cap=0.5)
    q, k, v = torch.randn(3, 2, 8) * 10, torch.randn(3, 2, 8) * 10, torch.randn(3, 2, 8)
    mask = attention_mask(cfg, torch.arange(3), torch.arange(3))
    scores = torch.einsum("lhd,shd->hls", q, k) * cfg.scale
    capped = 0.5 * torch.tanh(scores / 0.5)
    probs = torch.softmax(capped.masked_fill(~mask, float("-inf")), dim=-1)
    expected = torch.einsum("hls,shd->lhd", probs, v)
    torch.testing.assert_close(attend(cfg, q, k, v, 0), expected, atol=1e-5, rtol=1e-5)


def test_alibi_matches_an_sdpa_bias():
    torch.manual_seed(3)
    cfg = layer(2, 2)
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    slopes = torch.tensor([0.5, 0.25])
    pos = torch.arange(4)
    bias = slopes[:, None, None] * (pos[None, None, :] - pos[None, :, None])
    mask = attention_mask(cfg, pos, pos)
    expected = sdpa(q, k, v, mask, cfg.scale, bias)
    got = attend(cfg, q, k, v, 0, alibi_slopes=slopes)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
