"""Sessions only their creator can touch, in-process over loopback with the fake generator and
decoder (demo/fakes.py).

The hijack sequence: while one client's session runs, a second client asks for a session,
reads the refusal, and tries GetSession, CloseSession and Converse with the running
session's id (as if it had learned it): every call is NOT_FOUND, exactly as for an id that
does not exist, and the owner's session goes on and completes. Positive controls: the owner
(and whoever holds the token) reaches the session.
"""

import logging

import grpc
import pytest

from characters_jax.config import load_config
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.client.character_client import CharacterClient
from characters_jax.client.requests import start_request
from characters_jax.serving.conversation import Limits
from characters_jax.demo.fakes import FakeWorker
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.serving.session import SessionTable
from serving_harness import Recorder, png, speech

CFG = load_config("tiny")
SPEED = 4  # playout (and so the worker's pace) at 4x real time


@pytest.fixture(scope="module")
def worker():
    w = FakeWorker(CFG)
    yield w
    w.close()


def code_and_details(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def converse_with_id(stub, session_id: str, token: str = ""):
    return lambda: list(stub.Converse(iter([start_request(session_id=session_id, session_token=token)]), timeout=10))


def test_a_second_client_cannot_touch_a_running_session(worker):
    owner, intruder = CharacterClient(worker.address), CharacterClient(worker.address)
    try:
        conv = owner.conversation(image=png(), playout=PlayoutClock(SPEED * 24, prebuffer_frames=8))
        session = conv.wait_open()
        rec = Recorder(conv)
        rec.wait(lambda: len(rec.chunks) >= 2)
        assert session.state == pb.RUNNING and len(session.session_token) >= 40  # the creator's reply carries it

        code, busy = code_and_details(lambda: intruder.create_session(png()))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "another session" in busy
        assert session.session_id not in busy and session.session_token not in busy

        sid, stub = session.session_id, intruder.stub
        unknown = "0" * len(sid)
        attempts = {
            "get": lambda: intruder.get_session(sid),
            "get, a guessed token": lambda: intruder.get_session(sid, session_token="x" * 43),
            "get, a non-ASCII token": lambda: intruder.get_session(sid, session_token="é" * 43),
            "close": lambda: intruder.close_session(sid),
            "close, a guessed token": lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=sid, session_token="x" * 43), timeout=10),
            "converse": converse_with_id(stub, sid),
            "converse, a guessed token": converse_with_id(stub, sid, "x" * 43),
        }
        for name, attempt in attempts.items():
            code, details = code_and_details(attempt)
            assert code == grpc.StatusCode.NOT_FOUND, (name, code, details)
            assert session.session_token not in details
            # the same answer as for an id that does not exist: nothing tells the two apart
            assert details.replace(sid, unknown) == code_and_details(lambda: intruder.get_session(unknown))[1], name

        # the owner's session went on: it answers its owner, RUNNING, and completes
        mine = owner.get_session(sid)
        assert mine.state == pb.RUNNING and mine.session_token == ""  # GetSession never carries the token
        rec.send_speech(speech(0.5, seed=3), SPEED)
        conv.end_audio()
        rec.join()
        assert conv.final.state == pb.COMPLETED and conv.final.end_reason == pb.END_OF_AUDIO
        done = owner.get_session(sid)
        assert (done.state, done.end_reason) == (pb.COMPLETED, pb.END_OF_AUDIO)
    finally:
        owner.close()
        intruder.close()
    worker.server.table.wait_idle(5.0)


def test_the_token_is_the_credential_of_a_created_session(worker):
    with CharacterClient(worker.address) as owner, CharacterClient(worker.address) as other:
        created = owner.create_session(png())
        assert created.state == pb.READY and created.session_token
        assert other.get_session(created.session_id, session_token=created.session_token).state == pb.READY  # whoever holds it
        code, _ = code_and_details(lambda: other.converse(created.session_id, speech(0.2), realtime=False))
        assert code == grpc.StatusCode.NOT_FOUND
        res = owner.converse(created.session_id, speech(0.3), realtime=False, fps=SPEED * 24)
        assert res.final_event.state == pb.COMPLETED
        assert res.session.session_token == ""  # Converse(session_id) does not send it again
        assert owner.get_session(created.session_id).state == pb.COMPLETED

        blocker = owner.create_session(png())
        code, _ = code_and_details(lambda: other.close_session(blocker.session_id))
        assert code == grpc.StatusCode.NOT_FOUND and owner.get_session(blocker.session_id).state == pb.READY
        closed = owner.close_session(blocker.session_id)
        assert (closed.state, closed.end_reason, closed.session_token) == (pb.CANCELLED, pb.CLOSED, "")
    worker.server.table.wait_idle(5.0)


def test_tokens_never_reach_the_log(worker, caplog):
    with caplog.at_level(logging.DEBUG, logger="characters_jax"):
        with CharacterClient(worker.address) as c:
            created = c.create_session(png())
            res = c.converse(created.session_id, speech(0.2), realtime=False)
            opened = c.converse(None, speech(0.2), image=png(), realtime=False)
            code, _ = code_and_details(lambda: c.get_session(created.session_id, session_token="y" * 43))
        worker.server.table.wait_idle(5.0)
    tokens = {created.session_token, opened.session.session_token}
    assert all(tokens) and res.final_event.state == opened.final_event.state == pb.COMPLETED and code == grpc.StatusCode.NOT_FOUND
    logged = [str(r.__dict__) for r in caplog.records]
    assert any(created.session_id in line for line in logged)  # the log does name sessions (its own worker's) ...
    assert not any(t in line for t in tokens for line in logged)  # ... never their tokens
    assert all(t not in repr(worker.server.table.get(created.session_id)) for t in tokens)


def test_find_needs_the_token():
    table = SessionTable(lambda *a: None)
    rec = table.reserve(1, 0, Limits(10.0, 10.0))
    other = SessionTable(lambda *a: None).reserve(1, 0, Limits(10.0, 10.0))
    assert table.find(rec.session_id, rec.token) is rec
    assert table.find(rec.session_id, other.token) is None and table.find(rec.session_id, "") is None
    assert table.find("", rec.token) is None and table.find(other.session_id, other.token) is None
    assert rec.token != other.token and len(rec.token) >= 40
