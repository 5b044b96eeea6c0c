"""The operand layout that the attention-side kernels check before a launch (one helper for
qk_norm_rope, qk_norm_rope_attend, the one-launch decode attention and norm_linear_attend)."""

import pytest
import torch

from ttsbuild.plugins._tl._layout import check_qkv_caches

HQ, HKV, D = 4, 2, 32


def _operands(rows=3, slots=5, positions=17):
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D)
    k = torch.randn(slots, HKV, positions, D)
    return qkv, k, torch.randn_like(k)


def test_the_kernels_layout_passes():
    qkv, k, v = _operands()
    check_qkv_caches(qkv, k, v, HQ, HKV)
    check_qkv_caches(None, k, v, HQ, HKV)  # norm_linear_attend makes its qkv itself
    # rows need not be packed: a view of every other row of a wider buffer is fine
    check_qkv_caches(torch.randn(6, qkv.shape[1])[::2], k, v, HQ, HKV)


@pytest.mark.parametrize(
    "case, message",
    [
        ("qkv width", "qkv must be"),  # a query head too few
        ("qkv columns strided", "qkv must be"),
        ("caches differ", "share a layout"),
        ("head_dim strided", "share a layout"),
    ],
)
def test_a_wrong_layout_is_refused(case, message):
    qkv, k, v = _operands()
    if case == "qkv width":
        qkv = qkv[:, D:]
    elif case == "qkv columns strided":
        qkv = torch.randn(qkv.shape[1], qkv.shape[0]).T
    elif case == "caches differ":
        v = torch.randn(v.shape[0], v.shape[1], v.shape[2] + 1, D)[:, :, : v.shape[2]]
    else:
        k = torch.randn(*k.shape[:-1], 2 * D)[..., ::2]
        v = torch.randn(*v.shape[:-1], 2 * D)[..., ::2]
    with pytest.raises(ValueError, match=message):
        check_qkv_caches(qkv, k, v, HQ, HKV)
