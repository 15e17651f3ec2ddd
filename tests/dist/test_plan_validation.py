"""The planner's predicted per-rank peak is within 15% of one measured training step.

Each point starts fresh gloo ranks and runs one steady-state fp32 step of the tiny Llama of
benchmarks/plan_validation.py (the full set of points, at 8K-16K tokens, is that script's job;
here: small, fast ones). The CPU runtime constant is the calibrated one in the code
(easy_context.plan.estimate.CPU_RUNTIME_BYTES), the same for every point.
"""

import pytest

from benchmarks.plan_validation import TOLERANCE, Point, TinyLlama, compare, measure
from easy_context.plan.estimate import CPU_RUNTIME_BYTES

pytestmark = pytest.mark.slow  # ~60 s on the shared 2-core machine (fresh ranks per point)

# Two ranks with checkpointing (ring buffers, recompute), one rank without (stored
# activations); each point starts its own ranks, ~20-35 s on the shared 2-core machine.
POINTS = [Point("zigzag_ring_attn", 2, 4096, "full"),
          Point("ring_attn", 1, 4096, "none")]


@pytest.mark.parametrize("point", POINTS, ids=lambda p: p.key.replace(" ", "-"))
def test_predicted_peak_within_tolerance(point):
    model = TinyLlama()
    ranks = measure(model, point, timeout_s=300)
    row = compare(model, point, ranks, CPU_RUNTIME_BYTES)
    assert abs(row["error"]) <= TOLERANCE, (
        f"{point.key}: predicted {row['predicted_mb']:.0f} MB, measured {row['measured_mb']:.0f} MB "
        f"({100 * row['error']:+.1f}%); components {row['components_mb']}")
