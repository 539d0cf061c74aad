"""benchmarks/attention_ptx.py's PTX timeline: wgmma events in order, other instructions
counted between them (what ptxas' C7513/C7514 notes are about)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from attention_ptx import parse_kw, timeline  # noqa: E402

_PTX = """
.visible .entry k(
{
	.reg .b32 %r<10>;
$L__BB0_1:
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f1}, %rd1, %rd2, p, 1, 1;
	wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f1}, %rd1, %rd2, p, 1, 1;
	wgmma.commit_group.sync.aligned;
	mov.b32 %r1, {%rs1, %rs2};  // a register pack inside the stage
	mov.b32 %r2, {%rs3, %rs4};
	cvt.rn.satfinite.e4m3x2.f32 %rs5, %f2, %f3;
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f9}, {%r1,%r2}, %rd3, p, 1, 1;
	wgmma.commit_group.sync.aligned;
	wgmma.wait_group.sync.aligned 1;
	@%p1 bra $L__BB0_1;
	ex2.approx.f32 %f4, %f5;
	wgmma.wait_group.sync.aligned 0;
	ret;
}
"""


def test_timeline_orders_wgmma_events_and_counts_what_lies_between():
    assert timeline(_PTX) == [
        "fence", "mma_async x2", "commit_group",
        "    2 mov.b32, 1 cvt.rn.satfinite.e4m3x2.f32",
        "fence", "mma_async", "commit_group", "wait_group 1",
        "    1 bra, 1 ex2.approx.f32",
        "wait_group 0",
        "    1 ret",
    ]


def test_parse_kw_types():
    assert parse_kw(["overlap=qk", "bit_exp2=1", "stages=2", "pingpong=false"]) == {
        "overlap": "qk", "bit_exp2": True, "stages": 2, "pingpong": False}
