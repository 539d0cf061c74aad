"""The session's timeline and its pacing, without threads or processes: SpeechTimeline (speech
and inserted silence, bounded queue, history) and ConversationState's decisions on a manual
clock (lead over playback, waiting for late speech, limits, speech events, interrupts)."""

import numpy as np
import pytest

from characters_jax.audio.speech import SpeechQueueFull, SpeechTimeline
from characters_jax.audio.timeline import Timeline
from characters_jax.serving.conversation import RUN, Chunk, ConversationState, End, Limits, Note, StepPlan

TL = Timeline(16000, 24, 4)
STEP = TL.max_step_samples  # 2667


def check_timeline(timeline: np.ndarray, segments: dict, sent: dict):
    """Every span holds its segment's samples; everything else is silence; each segment's
    spans are in order and cover what was placed."""
    speech = np.zeros(len(timeline), bool)
    for number, seg in segments.items():
        offset = 0
        for span in seg.spans:
            assert span.offset == offset, (number, span)
            np.testing.assert_array_equal(timeline[span.position : span.position + span.samples], sent[number][offset : offset + span.samples])
            speech[span.position : span.position + span.samples] = True
            offset += span.samples
        assert offset == seg.placed
    assert not np.any(timeline[~speech]), "silence must be zeros"


def test_speech_and_inserted_silence_land_exactly_on_the_timeline():
    """Random pushes, segment ends and takes (seed 7): the timeline built from the takes
    holds every segment's samples in order, silence elsewhere, and history() reads it back."""
    rng = np.random.default_rng(7)
    st = SpeechTimeline(max_queued_samples=10**7, history_samples=3000)
    sent, segments, parts = {}, {}, []
    for _ in range(400):
        op = rng.integers(0, 4)
        if op == 0:
            pcm = rng.integers(1, 2**15, size=int(rng.integers(1, 4000)), dtype=np.int16)  # never 0: speech is told from silence
            seg = st.push(pcm)
            segments[seg.number] = seg
            sent[seg.number] = np.concatenate([sent.get(seg.number, np.zeros(0, np.int16)), pcm])
        elif op == 1:
            st.end_segment()
        else:
            n = int(rng.integers(1, 2 * STEP))
            a = st.take(n)
            assert a.start == sum(len(p) for p in parts) and len(a.audio) == n
            assert all(s.position >= a.start and s.position + s.samples <= a.start + n for s in a.spans)
            parts.append(a.audio)
            whole = np.concatenate(parts)
            lo = max(0, len(whole) - 3000)
            np.testing.assert_array_equal(st.history(lo, len(whole) + 50), whole[lo:])  # not past what is placed
            if lo >= 100:
                assert not st.history(lo - 100, lo).any()  # older than the kept history: zeros
    timeline = np.concatenate(parts)
    check_timeline(timeline, segments, sent)
    assert [s.number for s in segments.values()] == list(range(1, len(segments) + 1))
    starts = [s.start for s in segments.values() if s.spans]
    assert starts == sorted(starts)


def test_a_step_waits_only_inside_an_open_segment_and_the_last_one_is_trimmed():
    st = SpeechTimeline(10**6, 4000)
    assert not st.must_wait(STEP)  # listening: silence
    st.push(np.ones(1000, np.int16))
    assert st.must_wait(STEP)  # a segment still arriving
    st.end_segment()
    assert not st.must_wait(STEP)
    a = st.take(STEP)
    assert a.speech_samples == 1000 and [s.number for s in a.started] == [1] and [s.number for s in a.completed] == [1]
    assert len(a.audio) == STEP and not a.audio[1000:].any()
    st.push(np.full(500, 3, np.int16))
    a = st.take(STEP, end_of_audio=True)  # nothing follows: the step stops at its last speech sample
    assert len(a.audio) == 500 and a.spans[0].position == STEP


def test_queued_speech_is_bounded():
    st = SpeechTimeline(max_queued_samples=1000, history_samples=10)
    st.push(np.ones(800, np.int16))
    with pytest.raises(SpeechQueueFull, match="over the limit of 1000"):
        st.push(np.ones(300, np.int16))
    assert st.queued == 800  # the refused chunk is not queued
    st.take(500)
    st.push(np.ones(300, np.int16))
    assert st.queued == 600


class Fixture:
    """A ConversationState on a manual clock; emitted notes and chunks collected in order."""

    def __init__(self, lead=3, reports=True, begin_with_speech=False, max_duration=100.0, idle=50.0):
        self.t = 0.0
        self.out = []
        self.conv = ConversationState(TL, lambda read, s: read(*TL.step_span(s)), lead=lead, playout_reports=reports, begin_with_speech=begin_with_speech,
                                 limits=Limits(max_duration, idle), max_queued_samples=10**6, history_samples=3 * STEP,
                                 emit=lambda item: self.out.append(item.message if isinstance(item, Chunk) else item), now=lambda: self.t)

    def decide(self, s):
        with self.conv.cond:
            return self.conv.decide(s, self.t)

    def waits(self, s) -> bool:
        d = self.decide(s)
        return d is not RUN and not isinstance(d, End)

    def run(self, s) -> StepPlan:
        assert self.decide(s) == RUN, (s, self.decide(s))
        return self.conv.next_step(s)

    def emit(self, s) -> bool:
        """Puts step s's chunk on the stream (its message: ("chunk", s, first playback frame))."""
        placed = self.conv.chunk_placement(s)
        return placed is not None and self.conv.emit_chunk(placed, ("chunk", s, placed.first_play_frame), 4)

    def send(self, s):
        """Emits step s's chunk and has the stream deliver it at once."""
        if not self.emit(s):
            return False
        self.conv.delivered(4, self.conv.epoch)
        return True

    def notes(self, kind=None):
        return [x for x in self.out if isinstance(x, Note) and (kind is None or x.kind == kind)]


def test_listening_steps_run_up_to_the_lead_then_follow_the_reports():
    f = Fixture(lead=3)
    for s in range(3):
        plan = f.run(s)
        assert plan.audio.speech_samples == 0 and not plan.audio.audio.any()  # silence: the character listens
        f.send(s)
    assert f.waits(3)  # 3 steps ahead of playback: wait for a report
    f.conv.report_playout(4, 0)
    assert f.decide(3) == RUN


def test_without_reports_the_wall_clock_paces_from_the_first_chunk():
    f = Fixture(lead=2, reports=False)
    f.run(0)
    f.run(1)
    assert f.waits(2) and f.decide(2) == pytest.approx(50.0)  # nothing sent: the clock has not started
    f.send(0)
    f.send(1)  # playback starts now (t = 0), at frame 0
    f.t = 0.001
    f.run(2)  # playback has moved into step 0: step 2 is less than 2 ahead
    wait = f.decide(3)
    assert wait == pytest.approx(TL.step_seconds - 0.001, abs=1e-4)  # until playback enters step 1
    f.t += wait
    assert f.decide(3) == RUN


def test_late_speech_waits_until_playback_comes_close_then_silence_goes_in():
    f = Fixture(lead=3)
    f.conv.push_audio(np.ones(1000, np.int16))  # a segment that is still arriving
    assert f.waits(0)  # playback has not started: no hurry, wait for the speech
    f.conv.push_audio(np.ones(STEP - 1000, np.int16))
    f.run(0)
    f.send(0)
    f.conv.push_audio(np.ones(10, np.int16))
    f.conv.report_playout(1, 0)  # playback started; step 1 is 1 - 1/4 steps ahead
    assert f.conv.margin == pytest.approx(0.25)
    assert f.waits(1)  # above the margin: wait for more speech
    f.conv.report_playout(4, 0)  # step 1 is due now
    plan = f.run(1)
    assert plan.audio.spans[0].offset == STEP - 1 and plan.audio.speech_samples == 11 and not plan.audio.audio[11:].any()
    f.conv.push_audio(np.ones(STEP, np.int16))  # the segment goes on right after the inserted silence
    assert f.run(2).audio.spans[0].offset == STEP + 10


def test_begin_with_speech_waits_for_the_first_audio():
    f = Fixture(begin_with_speech=True)
    assert f.decide(0) == pytest.approx(50.0)  # no step before speech (only the idle limit wakes it)
    f.conv.push_audio(np.ones(STEP, np.int16))
    assert f.run(0).audio.spans[0].position == 0


def test_limits_end_on_time_with_their_reason():
    f = Fixture(max_duration=10.0, idle=2.0)
    f.t = 1.99
    assert not isinstance(f.decide(0), End)
    f.t = 2.0
    assert f.decide(0) == End("IDLE_TIMEOUT", "idle_timeout: no speech for 2 s")
    f.conv.push_audio(np.ones(100, np.int16))  # speech is activity, queued speech is pending
    f.t = 5.0
    assert not isinstance(f.decide(0), End)
    f.t = 10.0
    assert f.decide(0).reason == "MAX_DURATION"


def test_speech_events_come_beside_their_chunks_and_playback_finishes_by_the_reports():
    f = Fixture()
    f.run(0)
    f.send(0)  # listening
    f.conv.push_audio(np.ones(STEP + 100, np.int16))
    f.conv.end_speech()
    start = TL.step_span(1)[0]
    end = start + STEP + 100
    plan = f.run(1)
    assert plan.before == [Note("SPEAKING_STARTED", 1, start)] and plan.after == []
    f.send(1)
    plan = f.run(2)
    assert plan.after == [Note("SPEAKING_STOPPED", 1, end, STEP + 100)]
    f.send(2)
    kinds = [x[0] if isinstance(x, tuple) else x.kind for x in f.out]
    assert kinds == ["chunk", "SPEAKING_STARTED", "chunk", "chunk", "SPEAKING_STOPPED"]
    f.conv.report_playout(TL.frames_for(end) - 1, 0)
    assert not f.notes("PLAYBACK_FINISHED")
    f.conv.report_playout(TL.frames_for(end), 0)
    assert f.notes("PLAYBACK_FINISHED") == [Note("PLAYBACK_FINISHED", 1, end, STEP + 100)]


def test_a_client_that_stops_reading_holds_the_clock():
    """Without reports the wall clock paces, but only over frames the stream delivered."""
    f = Fixture(lead=2, reports=False)
    f.run(0)
    f.send(0)
    f.run(1)
    assert f.emit(1)  # on the stream, not taken by gRPC
    f.t = 10.0
    assert f.conv.playback.played(f.t) == 4  # the client can have played only what it got
    f.run(2)  # one step ahead of that
    assert f.waits(3)  # two: held, however late it is
    f.conv.delivered(4, f.conv.epoch)  # gRPC takes chunk 1: playback goes on from now
    f.t = 10.0 + 1.01 / 24
    assert f.decide(3) == RUN


def test_an_interrupt_while_a_chunk_is_built_drops_that_chunk():
    """The chunk's message is built outside the lock: an interrupt between its placement and
    its emission drops it (nothing of it reaches the stream); a chunk placed after plays."""
    f = Fixture(lead=3)
    f.conv.push_audio(np.arange(1, 3 * STEP, dtype=np.int16))
    f.run(0)
    f.run(1)
    f.send(0)
    placed = f.conv.chunk_placement(1)
    assert placed is not None and placed.first_play_frame == 4
    f.conv.interrupt(frames_played=2)
    before = len(f.out)
    assert not f.conv.emit_chunk(placed, ("chunk", 1, placed.first_play_frame), 4)
    assert len(f.out) == before and f.conv.chunk_placement(1) is None
    f.run(2)
    assert f.send(2) and f.out[-1] == ("chunk", 2, 2)  # right after the interrupted frame


def test_interrupt_drops_unsent_steps_and_reports_the_position():
    f = Fixture(lead=3)
    f.conv.push_audio(np.arange(1, 5 * STEP, dtype=np.int16))  # one long utterance
    for s in range(3):
        f.run(s)
    f.send(0)
    f.send(1)  # step 2 is placed, not sent
    ack = f.conv.interrupt(frames_played=5)  # the client was playing frame 5 (step 1)
    position = TL.frame_start(5)
    assert (ack.kind, ack.segment, ack.position, ack.segment_samples, ack.played_samples, ack.resume_step) == \
        ("INTERRUPTED", 1, position, position, position, 3)
    assert not f.send(2)  # dropped
    stopped, finished = f.notes("SPEAKING_STOPPED"), f.notes("PLAYBACK_FINISHED")
    assert stopped == [Note("SPEAKING_STOPPED", 1, position, position, True)] and finished == [Note("PLAYBACK_FINISHED", 1, position, position, True)]
    plan = f.run(3)  # listening again, right away
    assert plan.audio.speech_samples == 0 and f.conv.speech.queued == 0
    f.send(3)
    assert f.out[-1] == ("chunk", 3, 5)  # it plays right after the interrupted frame
    f.conv.report_playout(9, 0)
    second = f.conv.interrupt(frames_played=9)
    assert second.played_samples == position + TL.frame_start(16) - TL.frame_start(12) and second.segment == 0  # frames 0-4, then 12-15
