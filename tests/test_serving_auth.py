"""TLS, client certificates and bearer tokens, in-process over loopback with the fake generator
and decoder (demo/fakes.py), and the decoder link kept on this machine.

Every certificate is made here, in a temporary directory (a CA, the workers' certificate for
localhost and 127.0.0.1, a client certificate, an expired one, one from a foreign CA); no
key or certificate is in the repository. The workers run with
tls.worker_transport, the code behind the [serve] table's tls_cert, tls_key, tls_client_ca
and auth_tokens; clients use the library's ClientCredentials, loaded from the TOML file that
`talk` and `view` take.
"""

import argparse
import asyncio
import datetime
import ipaddress
import os
import pathlib
import subprocess
import sys
import threading

import grpc
import pytest

from characters_jax.audio.pcm import write_wav
from characters_jax.config import load_config
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.client.character_client import CharacterClient
from characters_jax.wire.service import SERVICE_NAME
from characters_jax.client.credentials import ClientCredentials, load_client_credentials
from characters_jax.serving.auth import bearer_token
from characters_jax.serving.tls import worker_transport
from characters_jax.wire.credential_files import certificate_validity, parse_tokens
from characters_jax.demo.fakes import FakeWorker
from characters_jax.processes import child_env
from serving_harness import png, speech

x509 = pytest.importorskip("cryptography.x509", reason="making test certificates needs the cryptography package (the view extra brings it)")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

CFG = load_config("tiny")
SPEED = 4  # playout at 4x real time
TOKEN = "worker-token-0123456789abcdef"
OTHER_TOKEN = "another-token-0123456789abcdef"


# -- certificates -------------------------------------------------------------------------------
def _name(cn: str):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(cn, issuer, *, ca=False, usage=None, san=(), days=(-1, 1)):
    """(certificate, key) signed by issuer (certificate, key), or self-signed when issuer is None."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    signer_name, signer_key = (issuer[0].subject, issuer[1]) if issuer else (_name(cn), key)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(signer_name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now + datetime.timedelta(days=days[0]))
         .not_valid_after(now + datetime.timedelta(days=days[1])).add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(list(san)), critical=False)
    return b.sign(signer_key, hashes.SHA256()), key


def _write(d: pathlib.Path, name: str, cert, key) -> tuple[str, str]:
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(d / f"{name}.pem"), str(d / f"{name}.key")


class Pki:
    """The test's certificates and token files, and client credentials files over them."""

    def __init__(self, d: pathlib.Path):
        self.dir = d
        ca = _issue("test ca", None, ca=True)
        self.ca, _ = _write(d, "ca", *ca)
        self.server_cert, self.server_key = _write(d, "server", *_issue(
            "worker", ca, usage=ExtendedKeyUsageOID.SERVER_AUTH, san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]))
        self.client_cert, self.client_key = _write(d, "client", *_issue("client", ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH))
        self.expired_cert, self.expired_key = _write(d, "expired", *_issue("old client", ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH, days=(-3, -1)))
        foreign = _issue("foreign ca", None, ca=True)
        self.foreign_cert, self.foreign_key = _write(d, "foreign", *_issue("stranger", foreign, usage=ExtendedKeyUsageOID.CLIENT_AUTH))
        self.tokens = d / "tokens"
        self.tokens.write_text(f"# the workers' bearer tokens\n{TOKEN}  # the test's client\n\n")
        for name, token in (("token", TOKEN), ("other_token", OTHER_TOKEN)):
            (d / name).write_text(token + "\n")
        self._n = 0

    def credentials_file(self, *, cert: str | None = "client", token: str | None = "token", **extra) -> str:
        """A client credentials TOML file: ca, cert/key named `cert`, token_file named `token`."""
        lines = ['ca = "ca.pem"']
        if cert:
            lines += [f'cert = "{cert}.pem"', f'key = "{cert}.key"']
        if token:
            lines.append(f'token_file = "{token}"')
        lines += [f'{k} = "{v}"' for k, v in extra.items()]
        self._n += 1
        path = self.dir / f"credentials{self._n}.toml"
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    def credentials(self, **kw) -> ClientCredentials:
        return load_client_credentials(self.credentials_file(**kw))

    def raw_channel(self, address: str, cert: str | None = "client") -> grpc.Channel:
        """A TLS channel without the library (no token, no certificate check of its own)."""
        read = lambda p: pathlib.Path(p).read_bytes()  # noqa: E731
        key, chain = (read(self.dir / f"{cert}.key"), read(self.dir / f"{cert}.pem")) if cert else (None, None)
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(read(self.ca), key, chain))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


def secure_worker(pki: Pki, *, client_ca: bool = True, tokens: str | None = None) -> FakeWorker:
    credentials, interceptors = worker_transport(pki.server_cert, pki.server_key, pki.ca if client_ca else None,
                                                 tokens or str(pki.tokens))
    return FakeWorker(CFG, credentials=credentials, interceptors=interceptors)


@pytest.fixture(scope="module")
def worker(pki):
    w = secure_worker(pki)
    yield w
    w.close()


def status_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def health_check(channel, service: str = "") -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


# -- end to end ---------------------------------------------------------------------------------
def test_a_session_over_mutual_tls_with_a_token(pki, worker):
    with CharacterClient(worker.address, credentials=pki.credentials()) as c:
        created = c.create_session(png())
        res = c.converse(created.session_id, speech(0.5), realtime=False)
        opened = c.converse(None, speech(0.3), image=png(seed=1), realtime=True, fps=SPEED * 24)
        assert c.get_session(created.session_id).state == pb.COMPLETED
    assert res.final_event.state == opened.final_event.state == pb.COMPLETED
    assert len(res.chunks) > 0 and len(opened.chunks) > 0


def test_the_viewer_link_uses_the_credentials(pki, worker):
    from characters_jax.viewer.link import WorkerLink

    async def run():
        link = WorkerLink(worker.address, pki.credentials())
        try:
            return await link.open(png(), timeout_s=10)
        finally:
            await link.close()

    assert asyncio.run(run()).width == CFG.video.width
    worker.server.table.wait_idle(5.0)


def test_talk_passes_its_credentials_file(pki, worker, tmp_path, capsys):
    from characters_jax.client.talk import talk_command

    (tmp_path / "face.png").write_bytes(png())
    write_wav(tmp_path / "speech.wav", speech(0.5))

    def talk(credentials):
        args = argparse.Namespace(server=worker.address, image=str(tmp_path / "face.png"), audio=str(tmp_path / "speech.wav"),
                                  out=str(tmp_path / "out.mp4"), prompt="", report=None, credentials=credentials,
                                  set=["talk.fast=true", "talk.open_timeout_s=10"])
        return talk_command(args)

    assert talk(pki.credentials_file()) == 0 and (tmp_path / "out.mp4").stat().st_size > 0
    assert talk(pki.credentials_file(cert="expired")) == 1
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and "expired" in err
    assert talk(str(tmp_path / "no-such.toml")) == 2


# -- refusals -----------------------------------------------------------------------------------
def test_a_wrong_or_absent_token_is_unauthenticated(pki, worker):
    for token, needle in ((None, "no bearer token"), ("other_token", "not accepted")):
        with CharacterClient(worker.address, credentials=pki.credentials(token=token)) as c:
            for name, call in (("CreateSession", lambda: c.create_session(png())),
                               ("Converse", lambda: c.conversation(image=png()).wait_open()),
                               ("GetSession", lambda: c.get_session("x"))):
                code, details = status_of(call)
                assert code == grpc.StatusCode.UNAUTHENTICATED and needle in details, (token, name, code, details)
                assert OTHER_TOKEN not in details
    with CharacterClient(worker.address, credentials=pki.credentials()) as c:  # the positive control
        assert status_of(lambda: c.get_session("x"))[0] == grpc.StatusCode.NOT_FOUND


def test_reflection_needs_the_token_and_health_does_not(pki, worker):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def list_services(channel):
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        return [r.list_services_response for r in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([req]), timeout=5)]

    with pki.raw_channel(worker.address) as ch:  # a client certificate, no token
        assert health_check(ch) == "SERVING" and health_check(ch, SERVICE_NAME) == "SERVING"
        code, details = status_of(lambda: list_services(ch))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "no bearer token" in details
    with CharacterClient(worker.address, credentials=pki.credentials()) as c:
        names = [s.name for s in list_services(c.channel)[0].service]
    assert "characters.v1.CharacterService" in names


def test_mutual_tls_refuses_a_missing_foreign_or_expired_client_certificate(pki, worker):
    for cert in (None, "foreign", "expired"):  # refused in the handshake: no RPC runs
        with pki.raw_channel(worker.address, cert=cert) as ch:
            code, _ = status_of(lambda: health_check(ch))
        assert code == grpc.StatusCode.UNAVAILABLE, cert
    with grpc.insecure_channel(worker.address) as ch:  # plaintext
        assert status_of(lambda: health_check(ch))[0] == grpc.StatusCode.UNAVAILABLE
    with pki.raw_channel(worker.address) as ch:  # the positive control: the CA's client certificate
        assert health_check(ch) == "SERVING"
    # the library refuses to present an expired certificate, with the reason
    code, details = status_of(lambda: CharacterClient(worker.address, credentials=pki.credentials(cert="expired")))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "client certificate expired at" in details
    # without a client certificate the library's call is refused too
    with CharacterClient(worker.address, credentials=pki.credentials(cert=None)) as c:
        assert status_of(lambda: c.get_session("x"))[0] == grpc.StatusCode.UNAVAILABLE


def test_the_token_file_is_reloaded_when_it_changes(pki, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    w = secure_worker(pki, client_ca=False, tokens=str(tokens))
    try:
        def code_with(token_file):
            with CharacterClient(w.address, credentials=pki.credentials(cert=None, token=token_file)) as c:
                return status_of(lambda: c.get_session("x"))[0]

        def replace(text):
            tmp = tmp_path / "tokens.new"
            tmp.write_text(text)
            os.replace(tmp, tokens)

        ok, refused = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED  # NOT_FOUND: past the token check
        assert (code_with("token"), code_with("other_token")) == (ok, refused)
        replace(f"{TOKEN}\n{OTHER_TOKEN}  # added\n")
        assert (code_with("token"), code_with("other_token")) == (ok, ok)
        replace(f"# {TOKEN} revoked\n{OTHER_TOKEN}\n")
        assert (code_with("token"), code_with("other_token")) == (refused, ok)
        replace("short\n")  # unusable: nothing is accepted until it is fixed
        assert (code_with("token"), code_with("other_token")) == (refused, refused)
        replace(f"{TOKEN}\n")
        assert (code_with("token"), code_with("other_token")) == (ok, refused)
    finally:
        w.close()


# -- balanced -----------------------------------------------------------------------------------
def test_six_clients_on_three_workers_over_tls_with_tokens(pki):
    """A comma list of 127.0.0.1 workers (verified as 127.0.0.1, the list's first host), gRPC's
    round_robin with health checks: every session completes, one at a time per worker."""
    workers = [secure_worker(pki) for _ in range(3)]
    target = ",".join(w.address for w in workers)
    credentials = pki.credentials()
    spans, errors = [], []

    def one(i):
        try:
            with CharacterClient(target, credentials=credentials) as c:
                res = c.converse(None, speech(0.4, seed=i), image=png(seed=i), realtime=True, fps=SPEED * 24)
            spans.append((res.session.worker_id, res.open_time, res.recv_times[-1], res.final_event.state))
        except grpc.RpcError as err:
            errors.append((err.code(), err.details()))

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with CharacterClient(f"dns:///localhost:{workers[0].server.port}", credentials=credentials) as c:  # a DNS target
            by_name = c.converse(None, speech(0.2), image=png(), realtime=False)
    finally:
        for w in workers:
            w.close()
    assert errors == [] and len(spans) == 6 and all(s[3] == pb.COMPLETED for s in spans)
    assert by_name.final_event.state == pb.COMPLETED
    by_worker = {}
    for wid, a, b, _ in spans:
        by_worker.setdefault(wid, []).append((a, b))
    assert set(by_worker) == {w.server.options.worker_id for w in workers}
    for runs in by_worker.values():
        runs.sort()
        assert all(later[0] >= earlier[1] for earlier, later in zip(runs, runs[1:])), runs


# -- configuration ------------------------------------------------------------------------------
def test_the_flags_and_files_are_checked(pki, tmp_path):
    for args, needle in (((pki.server_cert, None), "give both"), ((None, None, pki.ca), "serve.tls_client_ca: needs TLS"),
                         ((None, None, None, str(pki.tokens)), "serve.auth_tokens: needs TLS"),
                         ((pki.server_cert, pki.client_key), "key values mismatch"),
                         ((pki.expired_cert, pki.expired_key), "expired at"),
                         ((pki.server_cert, pki.server_key, None, str(tmp_path / "none")), "cannot read")):
        with pytest.raises(ValueError, match=needle):
            worker_transport(*args)
    (pki.dir / "two_tokens").write_text(f"{TOKEN}\n{OTHER_TOKEN}\n")
    for text, needle in (('cert = "client.pem"\n', "go together"), ('colour = "blue"\n', "unknown keys"), ("ca = [", "not TOML"),
                         ('token_file = "two_tokens"\n', "must hold one token"), ('ca = "missing.pem"\n', "missing.pem")):
        path = pki.dir / "bad.toml"
        path.write_text(text)
        with pytest.raises(ValueError, match=needle):
            load_client_credentials(path)
    assert "worker-token" not in repr(pki.credentials()) and "PRIVATE" not in repr(pki.credentials())


def test_token_lines_and_metadata():
    assert parse_tokens(f"# comment\n\n  {TOKEN}  # trailing\n{OTHER_TOKEN}\n", "f") == [TOKEN, OTHER_TOKEN]
    for bad in ("tooshort\n", f"{TOKEN} {OTHER_TOKEN}\n"):
        with pytest.raises(ValueError, match="line 1") as e:
            parse_tokens(bad, "f")
        assert "tooshort" not in str(e.value) and TOKEN not in str(e.value)  # the message never shows a token
    assert bearer_token([("authorization", f"Bearer {TOKEN}")]) == TOKEN
    assert bearer_token([("Authorization", f"bearer  {TOKEN} ")]) == TOKEN
    assert bearer_token([("authorization", f"Basic {TOKEN}")]) is None and bearer_token([]) is None and bearer_token(None) is None


def test_certificate_dates_match_the_cryptography_package(pki):
    for path in (pki.ca, pki.client_cert, pki.expired_cert):
        pem = pathlib.Path(path).read_bytes()
        cert = x509.load_pem_x509_certificate(pem)
        assert certificate_validity(pem) == (cert.not_valid_before_utc, cert.not_valid_after_utc)


# -- the decoder link stays on this machine -----------------------------------------------------
def test_the_decoder_link_refuses_addresses_off_this_machine(tmp_path):
    from characters_jax.decoder.address import require_loopback

    for ok in ("unix:/tmp/decoder.sock", "127.0.0.1:50052", "[::1]:1", "localhost:2"):
        assert require_loopback(ok) == ok
    for bad in ("0.0.0.0:50052", "10.1.2.3:50052", ":50052", "[::]:1", "decoder.example:1", "127.0.0.1"):
        with pytest.raises(ValueError, match="stays on this machine"):
            require_loopback(bad)
    runs = {
        "decode-serve": ["decode-serve", "--config", "tiny", "--listen", "0.0.0.0:0"],
        "serve": ["serve", "--config", "tiny", "--set", "serve.decoder=10.1.2.3:50052", "--port", "0", "--set", "serve.metrics_port=-1"],
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "characters_jax.cli", *argv], env=child_env(1), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, argv in runs.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        flag = "--listen '0.0.0.0:0'" if name == "decode-serve" else "serve.decoder '10.1.2.3:50052'"
        assert proc.returncode == 2 and f"characters-jax {name}: {flag}: the decoder link has no TLS" in err, (name, proc.returncode, err[-2000:])
