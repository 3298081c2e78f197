"""The conformance suite's MLA cells: the shipped MLA backends pass (the Triton kernel in the
interpreter on CPU, on the GPU where there is one), and wrong backends fail with the error."""

import attrs
import torch

from unified_attn.backends.mla import MLAReferenceBackend
from unified_attn.harness.conformance import run_conformance
from unified_attn.harness.conformance.mla_cells import MLA_GRID

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WINDOW = "mla: sliding window 8"


def test_the_mla_reference_backend_passes_every_mla_cell():
    report = run_conformance("mla-reference")
    assert report["ok"] and report["passed"] == len(MLA_GRID), report["cells"]
    assert {r["type"] for r in report["cells"]} == {"mla"}
    checks = report["cells"][0]["checks"]
    assert checks["cache config pure"] == checks["in-place output"] == "pass"
    assert checks["rejects bad inputs"] == "pass"
    assert report["cells"][-1]["checks"]["fp8 bytes"] == "pass"  # the fp8 latent cache cell


def test_the_triton_mla_backend_passes_and_refuses_windows():
    # (the interpreter is slow: on the CPU the mixed, chunked, window and fp8 cells)
    cells = MLA_GRID if DEVICE == "cuda" else (*MLA_GRID[2:5], MLA_GRID[-1])
    report = run_conformance("triton-mla", DEVICE, cells=cells)
    rows = {r["cell"]: r for r in report["cells"]}
    assert report["ok"], [(r["cell"], r["detail"]) for r in report["cells"]]
    assert rows[WINDOW]["status"] == "unsupported"
    assert "sliding windows are not supported" in rows[WINDOW]["detail"]
    assert report["passed"] == len(cells) - 1
    assert rows["mla: mixed, fp8 latent cache"]["checks"]["fp8 bytes"] == "pass"


class WrongScaleMLA(MLAReferenceBackend):
    def forward(self, layer, output, query, key, value, **kwargs):
        return super().forward(attrs.evolve(layer, scale=layer.scale * 1.1), output, query, key,
                               value, **kwargs)  # fmt: skip


class ForgetsTheCache(MLAReferenceBackend):
    """Writes nothing: steps that read earlier tokens see the garbage."""

    def write_latent(self, latent, cache, slot_mapping):
        return None


def test_wrong_mla_backends_fail_with_the_error():
    report = run_conformance(WrongScaleMLA, cells=MLA_GRID[:3])
    assert report["failed"] == 3 and not report["ok"]
    assert all("max error" in r["detail"] for r in report["cells"])
    forgets = run_conformance(ForgetsTheCache, cells=MLA_GRID[:2])
    assert [r["status"] for r in forgets["cells"]] == ["fail", "fail"]


class IgnoresTheCheckpointScale(MLAReferenceBackend):
    """Quantizes the latent cache with scale 1 instead of the kv_scales it is given."""

    def forward(self, layer, output, query, key, value, **kwargs):
        kwargs["kv_scales"] = torch.ones_like(kwargs["kv_scales"])
        return super().forward(layer, output, query, key, value, **kwargs)


def test_an_fp8_backend_that_ignores_the_scale_fails():
    fp8 = [c for c in MLA_GRID if c.kv_cache_dtype == "fp8"]
    (row,) = run_conformance(IgnoresTheCheckpointScale, cells=fp8)["cells"]
    assert row["status"] == "fail" and row["checks"]["fp8 bytes"].startswith("fail")
