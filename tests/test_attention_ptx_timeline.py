"""benchmarks/attention_ptx.py's PTX timeline: wgmma events in order, other instructions
counted between them (what ptxas' C7513/C7514 notes are about)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from attention_ptx import parse_kw, sass_timeline, timeline  # noqa: E402

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


_SASS = """
        /*2670*/                   WARPGROUP.ARRIVE ;                                   /* 0x00000000000079c5 */
                                                                                        /* 0x000fe20000000000 */
        /*2760*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR56], RZ, !UPT ;  /* 0x01e00000381879f3 */
        /*2870*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24 ;       /* 0x01e00000081879f3 */
        /*28e0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                      /* 0x00008000000079c5 */
        /*29e0*/                   LDG.E R158, desc[UR4][R200.64] ;                     /* 0x0 */
        /*2a00*/                   ISETP.NE.U32.AND P2, PT, R158, RZ, PT ;              /* 0x0 */
        /*2a10*/              @!P2 BRA 0x4410 ;                                         /* 0x0 */
        /*2a20*/                   FFMA.SAT R1, R2, R3, R4 ;                            /* 0x0 */
        /*2a30*/                   FFMA.SAT R5, R2, R3, R4 ;                            /* 0x0 */
        /*2a40*/                   PRMT R6, R1, 0x40, R5 ;                              /* 0x0 */
        /*5950*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR10], R24 ;     /* 0x0 */
        /*5a10*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, R28, gdesc[UR8], R88 ;  /* 0x0 */
"""


def test_sass_timeline_marks_wgmma_waits_and_counts_between():
    assert sass_timeline(_SASS) == [
        "0x2670 fence", "0x2760 mma 64x128x32 x2", "0x28e0 wait gsb0 0x0",
        "    2 FFMA.SAT, 1 LDG.E, 1 ISETP.NE.U32.AND, 1 BRA, 1 PRMT",
        "0x5950 mbarrier_wait", "0x5a10 mma 64x128x32",
    ]
