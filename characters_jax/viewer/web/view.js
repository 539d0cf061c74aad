// The live page: microphone (or a WAV file) up, the character's video and voice down, over
// WebRTC to the characters-jax gateway on this machine; the session's figures beside it.
//
// Measurements, all on the page's performance clock:
// - decoded fps: frames presented per second (requestVideoFrameCallback) and getStats'
//   framesDecoded;
// - first frame: from the Connect press to the first presented frame;
// - sound -> frame on screen: a sound onset at the microphone (onset-worklet.js on the track
//   that is sent) against the display time of the first frame that carries it. The gateway
//   sends, per chunk, the peak of the audio each frame carries; the frame with the matching
//   onset is found among the presented frames by its RTP timestamp (frame k has
//   k * 90000 / fps, counted from the first frame);
// - sound -> voice back: the same onset detected in the returned voice track.
// window.viewer.metrics() returns all of it as plain data.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const VIDEO_CLOCK_HZ = 90000;
  // onset-worklet.js's rule per frame: frame k reaches `high`, frame k - 1 does not (a rise
  // of up to one frame), and the `quietFrames` frames before that stay below `low`.
  const FRAME_ONSET = { high: 0.5, low: 0.3, quietFrames: 4 };
  const MATCH_WINDOW_MS = 3000;
  const KEEP = 1800; // per-frame and per-poll records kept (over a minute)

  let referenceImage = null; // base64 of an uploaded image; null: the gateway's default
  let wavFile = null;
  let call = null; // the live call's objects and records
  let workerReady = false;
  let nextAudio = null; // an AudioContext with the onset worklet loaded, made ahead of the call

  function prepareAudio() {
    const ctx = new AudioContext({ latencyHint: "interactive" });
    return ctx.audioWorklet.addModule("/static/onset-worklet.js").then(() => ctx);
  }

  function newCall() {
    return {
      pc: null, dc: null, ctx: null, micStream: null, remote: new MediaStream(),
      tConnect: performance.now(), tFirstFrame: null, state: "CONNECTING", closedReason: null,
      fps: 24, session: null, rtp0: null, frameIndexFrom: null,
      presented: [], // [frame index, expected display time, callback time, frames presented so far]
      stats: [], // getStats polls
      micOnsets: [], voiceOnsets: [], frameOnsets: [], framePeaks: [],
      frameLatencies: [], voiceLatencies: [], chunks: [], playout: null,
      usedForFrame: new Set(), usedForVoice: new Set(), pendingFrameOnsets: [],
      micLevel: 0, voiceLevel: 0, statsTimer: null, marks: {}, speechEvents: [],
    };
  }

  // -- page furniture ------------------------------------------------------------------------
  function showMessage(text, kind = "error") {
    const m = $("message");
    m.textContent = text;
    m.className = "message" + (kind === "info" ? " info" : "");
    m.hidden = !text;
  }

  function showImageError(text) {
    const e = $("image-error");
    e.textContent = text;
    e.hidden = !text;
  }

  // The gateway answers JSON ({error: ...} when it refuses); anything else is named by its status.
  async function readJson(resp) {
    try {
      return await resp.json();
    } catch (err) {
      return { error: `the gateway answered HTTP ${resp.status} ${resp.statusText}`.trim() };
    }
  }

  function logEvent(text) {
    const li = document.createElement("li");
    li.textContent = `${new Date().toLocaleTimeString()}  ${text}`;
    $("events").prepend(li);
    while ($("events").children.length > 50) $("events").lastChild.remove();
  }

  function setState(state, message) {
    if (call) call.state = state;
    $("state-badge").textContent = state;
    $("state-badge").className = "badge " + state;
    $("m-state").textContent = state.toLowerCase();
    logEvent(message ? `${state}: ${message}` : state);
  }

  function setButtons() {
    const live = call !== null && call.closedReason === null;
    $("connect").disabled = live || !workerReady;
    $("hangup").disabled = !live;
    $("interrupt").disabled = !live || !call.session;
  }

  async function pollWorker() {
    try {
      const s = await (await fetch("/status", { cache: "no-store" })).json();
      workerReady = s.worker === "ready";
      const pill = $("worker-status");
      pill.textContent = `worker: ${s.worker}${s.message ? " · " + s.message : ""}`;
      pill.className = "pill " + s.worker;
    } catch (err) {
      workerReady = false;
      $("worker-status").textContent = "gateway unreachable";
    }
    setButtons();
  }

  // -- reference image and WAV ---------------------------------------------------------------
  function readAsBase64(file) {
    return new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(String(r.result).split(",", 2)[1] || "");
      r.onerror = () => reject(r.error);
      r.readAsDataURL(file);
    });
  }

  async function onImageChosen(ev) {
    const file = ev.target.files[0];
    ev.target.value = "";
    if (!file) return;
    let body;
    try {
      const resp = await fetch("/image", { method: "POST", body: file });
      body = await readJson(resp);
      if (!resp.ok) throw new Error(body.error || `the gateway answered HTTP ${resp.status}`);
    } catch (err) {
      showImageError(`"${file.name}" cannot be the reference image: ${err.message || err}`);
      return;
    }
    showImageError("");
    referenceImage = await readAsBase64(file);
    $("reference").src = URL.createObjectURL(file);
    showMessage(`reference image: ${file.name}`, "info");
  }

  async function voiceTrack(ctx) {
    if ($("audio-source").value === "wav") {
      if (!wavFile) throw new Error("choose a WAV file first (voice from: a WAV file)");
      let buffer;
      try {
        buffer = await ctx.decodeAudioData(await wavFile.arrayBuffer());
      } catch (err) {
        throw new Error(`"${wavFile.name}" is not an audio file this browser can decode`);
      }
      const src = ctx.createBufferSource();
      src.buffer = buffer;
      const dest = ctx.createMediaStreamDestination();
      src.connect(dest);
      src.start();
      return dest.stream;
    }
    const ec = new URLSearchParams(location.search).get("echo_cancellation") !== "0";
    return navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: ec, noiseSuppression: false, autoGainControl: false, channelCount: 1 },
      video: false,
    });
  }

  // -- audio taps ------------------------------------------------------------------------------
  function tap(ctx, stream, onOnset, onLevel) {
    const node = new AudioWorkletNode(ctx, "onset-detector", { numberOfOutputs: 1 });
    node.port.onmessage = (e) => {
      const m = e.data;
      // The worklet's context time -> this page's performance clock.
      const t = performance.now() - (ctx.currentTime - m.time) * 1000;
      if (m.type === "onset") onOnset(t, m.peak);
      else onLevel(m.peak);
    };
    ctx.createMediaStreamSource(stream).connect(node);
    node.connect(ctx.destination); // pulled by the graph; the node outputs silence
    return node;
  }

  function matchOnset(onsets, used, t) {
    // The latest microphone onset before t (within the window) not matched yet.
    for (let i = onsets.length - 1; i >= 0; i--) {
      const m = onsets[i];
      if (m >= t) continue;
      if (t - m > MATCH_WINDOW_MS) break;
      if (used.has(i)) return null;
      used.add(i);
      return m;
    }
    return null;
  }

  function onMicOnset(t) {
    call.micOnsets.push(t);
  }

  function onVoiceOnset(t) {
    call.voiceOnsets.push(t);
    const m = matchOnset(call.micOnsets, call.usedForVoice, t);
    if (m !== null) call.voiceLatencies.push(t - m);
  }

  // -- video frames ----------------------------------------------------------------------------
  function onVideoFrame(now, md) {
    if (!call || call.closedReason !== null) return;
    let index;
    if (typeof md.rtpTimestamp === "number") {
      if (call.rtp0 === null) call.rtp0 = md.rtpTimestamp;
      index = Math.round(((md.rtpTimestamp - call.rtp0) >>> 0) / (VIDEO_CLOCK_HZ / call.fps));
      call.frameIndexFrom = "rtp";
    } else {
      index = call.presented.length ? call.presented[call.presented.length - 1][0] + 1 : 0;
      call.frameIndexFrom = "count";
    }
    if (call.tFirstFrame === null) {
      call.tFirstFrame = now;
      $("placeholder").hidden = true;
    }
    const shown = md.expectedDisplayTime || now;
    call.presented.push([index, shown, now, md.presentedFrames]);
    if (call.presented.length > KEEP) call.presented.splice(0, call.presented.length - KEEP);
    while (call.pendingFrameOnsets.length && call.pendingFrameOnsets[0] <= index) {
      const k = call.pendingFrameOnsets.shift();
      const m = matchOnset(call.micOnsets, call.usedForFrame, shown);
      if (m !== null) call.frameLatencies.push({ frame: k, shownFrame: index, latencyMs: shown - m });
    }
    $("video").requestVideoFrameCallback(onVideoFrame);
  }

  // -- gateway messages ------------------------------------------------------------------------
  function onChunk(m) {
    call.chunks.push(m);
    if (call.chunks.length > KEEP) call.chunks.shift();
    const h = call.framePeaks; // the last quietFrames + 1 frames' peaks
    m.peaks.forEach((p, i) => {
      const n = FRAME_ONSET.quietFrames;
      if (p >= FRAME_ONSET.high && h.length === n + 1 && h[n] < FRAME_ONSET.high && h.slice(0, n).every((q) => q < FRAME_ONSET.low)) {
        call.frameOnsets.push(m.first_frame + i);
        call.pendingFrameOnsets.push(m.first_frame + i);
      }
      h.push(p);
      if (h.length > n + 1) h.shift();
    });
  }

  function onGatewayMessage(m) {
    if (!call) return;
    if (m.type === "session") {
      call.session = m;
      call.fps = m.fps;
      setButtons();
      logEvent(`session ${m.session_id.slice(0, 8)}: ${m.width}x${m.height} at ${m.fps} fps`);
    } else if (m.type === "state") {
      setState(m.state, [m.end_reason, m.message].filter(Boolean).join(": "));
    } else if (m.type === "speech") {
      call.speechEvents.push(m);
      logEvent(`${m.kind.toLowerCase().replace("_", " ")} · segment ${m.segment} at ${m.position_s.toFixed(2)} s${m.interrupted ? " (cut by an interrupt)" : ""}`);
    } else if (m.type === "interrupting") {
      logEvent(`interrupt at frame ${m.frames_played}`);
    } else if (m.type === "chunk") {
      onChunk(m);
    } else if (m.type === "playout") {
      call.playout = m;
    } else if (m.type === "closed") {
      closeCall(m.reason);
    }
  }

  // -- stats -----------------------------------------------------------------------------------
  async function pollStats() {
    if (!call || !call.pc) return;
    const rec = { t: null };
    (await call.pc.getStats()).forEach((s) => {
      if (s.type !== "inbound-rtp") return;
      if (s.kind === "video") {
        Object.assign(rec, {
          t: s.timestamp - performance.timeOrigin, // when the browser took these figures

          framesDecoded: s.framesDecoded, framesDropped: s.framesDropped, freezeCount: s.freezeCount,
          jitterBufferMs: s.jitterBufferEmittedCount ? (1000 * s.jitterBufferDelay) / s.jitterBufferEmittedCount : null,
        });
      } else if (s.kind === "audio") {
        Object.assign(rec, { audioPackets: s.packetsReceived, audioSamples: s.totalSamplesReceived, audioEnergy: s.totalAudioEnergy });
      }
    });
    if (rec.t === null) rec.t = performance.now();
    call.stats.push(rec);
    if (call.stats.length > KEEP) call.stats.shift();
    render();
  }

  const median = (xs) => {
    if (!xs.length) return null;
    const s = [...xs].sort((a, b) => a - b);
    return s[Math.floor(s.length / 2)];
  };
  const ms = (x) => (x === null || x === undefined ? "–" : `${Math.round(x)} ms`);

  function render() {
    const c = call;
    const now = performance.now();
    const recent = c.presented.filter((p) => p[2] > now - 1000).length;
    $("m-fps").textContent = c.tFirstFrame ? `${recent}` : "–";
    $("m-first").textContent = c.tFirstFrame ? ms(c.tFirstFrame - c.tConnect) : "–";
    const fl = c.frameLatencies.map((x) => x.latencyMs);
    $("m-latency-frame").textContent = fl.length ? `${ms(fl[fl.length - 1])} (median ${ms(median(fl))}, ${fl.length})` : "–";
    const vl = c.voiceLatencies;
    $("m-latency-voice").textContent = vl.length ? `${ms(vl[vl.length - 1])} (median ${ms(median(vl))})` : "–";
    const cl = c.chunks.map((x) => x.arrival_latency_s).filter((x) => x !== null);
    $("m-latency-chunk").textContent = cl.length ? ms(1000 * median(cl)) : "–";
    const st = c.chunks.map((x) => x.diffusion_ms), dc = c.chunks.map((x) => x.decode_ms);
    $("m-step").textContent = st.length ? `${median(st).toFixed(1)} / ${median(dc).toFixed(1)} ms` : "–";
    if (c.playout) {
      $("m-underruns").textContent = `${c.playout.underruns} (stalled ${c.playout.stalled_s.toFixed(2)} s, ${c.playout.catchups} catch-ups)`;
      $("m-buffer").textContent = `${c.playout.buffered_frames} frames · ${c.playout.frames_played} played`;
    }
    const s = c.stats[c.stats.length - 1];
    if (s) {
      $("m-browser").textContent = `${s.freezeCount ?? "–"} · ${ms(s.jitterBufferMs)}`;
      $("m-audio").textContent = s.audioSamples ? `${(s.audioSamples / 48000).toFixed(1)} s` : "none yet";
    }
    $("mic-level").value = c.micLevel;
    $("voice-level").value = c.voiceLevel;
  }

  // -- the call --------------------------------------------------------------------------------
  function iceGatheringDone(pc, timeoutMs) {
    if (pc.iceGatheringState === "complete") return Promise.resolve();
    return new Promise((resolve) => {
      const done = () => { if (pc.iceGatheringState === "complete") resolve(); };
      pc.addEventListener("icegatheringstatechange", done);
      setTimeout(resolve, timeoutMs);
    });
  }

  async function connect() {
    showMessage("");
    call = newCall();
    const c = call;
    setButtons();
    setState("CONNECTING");
    try {
      const audio = nextAudio || prepareAudio();
      nextAudio = null;
      c.ctx = await audio;
      await c.ctx.resume(); // allowed now: the Connect press is a user gesture
      c.micStream = await voiceTrack(c.ctx);
      tap(c.ctx, c.micStream, onMicOnset, (p) => (c.micLevel = p));
      const pc = (c.pc = new RTCPeerConnection({ iceServers: [] }));
      pc.addTransceiver(c.micStream.getAudioTracks()[0], { direction: "sendrecv" });
      pc.addTransceiver("video", { direction: "recvonly" });
      c.dc = pc.createDataChannel("events");
      c.dc.onmessage = (e) => onGatewayMessage(JSON.parse(e.data));
      pc.ontrack = (e) => {
        c.remote.addTrack(e.track);
        $("video").srcObject = c.remote;
        if (e.track.kind === "audio") tap(c.ctx, new MediaStream([e.track]), onVoiceOnset, (p) => (c.voiceLevel = p));
      };
      pc.onconnectionstatechange = () => {
        if (pc.connectionState === "failed") closeCall("the connection to the gateway failed");
      };
      c.marks.setup = performance.now() - c.tConnect;
      await pc.setLocalDescription(await pc.createOffer());
      await iceGatheringDone(pc, 3000);
      c.marks.gathered = performance.now() - c.tConnect;
      const resp = await fetch("/offer", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ sdp: pc.localDescription.sdp, type: "offer", image: referenceImage, prompt: $("prompt").value }),
      });
      const body = await readJson(resp);
      if (!resp.ok) throw new Error(body.error || `the gateway answered HTTP ${resp.status}`);
      c.marks.answered = performance.now() - c.tConnect;
      await pc.setRemoteDescription(body);
      $("video").requestVideoFrameCallback(onVideoFrame);
      c.statsTimer = setInterval(pollStats, 500);
    } catch (err) {
      showMessage(String(err.message || err));
      closeCall(String(err.message || err));
    }
  }

  function closeCall(reason) {
    const c = call;
    if (!c || c.closedReason !== null) return;
    c.closedReason = reason;
    if (c.dc && c.dc.readyState === "open") c.dc.send(JSON.stringify({ type: "hangup" }));
    if (c.statsTimer) clearInterval(c.statsTimer);
    if (c.pc) c.pc.close();
    if (c.micStream) c.micStream.getTracks().forEach((t) => t.stop());
    if (c.ctx) c.ctx.close();
    nextAudio = prepareAudio();
    if (c.state === "RUNNING" || c.state === "CONNECTING") setState("CLOSED", reason);
    else logEvent(`closed: ${reason}`);
    setButtons();
  }

  function interrupt() {
    if (call && call.dc && call.dc.readyState === "open") call.dc.send(JSON.stringify({ type: "interrupt" }));
  }

  function metrics() {
    const c = call;
    if (!c) return null;
    return {
      state: c.state, closedReason: c.closedReason, session: c.session, message: $("message").hidden ? "" : $("message").textContent,
      imageError: $("image-error").hidden ? "" : $("image-error").textContent,
      tConnect: c.tConnect, tFirstFrame: c.tFirstFrame, firstFrameMs: c.tFirstFrame === null ? null : c.tFirstFrame - c.tConnect,
      frameIndexFrom: c.frameIndexFrom, presented: c.presented, stats: c.stats, playout: c.playout,
      micOnsets: c.micOnsets, voiceOnsets: c.voiceOnsets, frameOnsets: c.frameOnsets,
      frameLatencies: c.frameLatencies, voiceLatencies: c.voiceLatencies, speechEvents: c.speechEvents,
      chunkLatencies: c.chunks.map((x) => x.arrival_latency_s), now: performance.now(),
      audioContext: c.ctx ? c.ctx.state : null, micLevel: c.micLevel, voiceLevel: c.voiceLevel, marks: c.marks,
    };
  }

  $("connect").addEventListener("click", connect);
  $("hangup").addEventListener("click", () => closeCall("hung up"));
  $("interrupt").addEventListener("click", interrupt);
  $("image-file").addEventListener("change", onImageChosen);
  $("audio-source").addEventListener("change", (e) => { if (e.target.value === "wav") $("wav-file").click(); });
  $("wav-file").addEventListener("change", (e) => {
    wavFile = e.target.files[0] || null;
    if (wavFile) showMessage(`voice from ${wavFile.name}`, "info");
  });
  window.addEventListener("pagehide", () => closeCall("the page was closed"));
  window.viewer = { connect, hangup: () => closeCall("hung up"), interrupt, metrics };
  nextAudio = prepareAudio();
  pollWorker();
  setInterval(pollWorker, 1000);
})();
