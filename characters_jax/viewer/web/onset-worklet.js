// AudioWorklet: a level meter and a sound-onset detector for one audio stream.
//
// An onset is the first render quantum (128 samples) whose peak |x| reaches `high` after a
// quiet stretch: every quantum between `quietSeconds + rampSeconds` and `rampSeconds` before
// it stayed below `low`, and none in the last `rampSeconds` reached `high` (a sound may take
// up to `rampSeconds` to rise). It is posted with the context time of its first loud sample.
// The page applies the same rule, frame by frame, to the audio each video frame carries.
// The level (peak over ~50 ms) is posted 20 times a second.
class OnsetDetector extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = (options && options.processorOptions) || {};
    this.high = o.high ?? 0.5;
    this.low = o.low ?? 0.3;
    this.quietSeconds = o.quietSeconds ?? 0.15;
    this.rampSeconds = o.rampSeconds ?? 0.05;
    this.history = []; // [time, peak] of the quanta of the last quietSeconds + rampSeconds
    this.levelPeak = 0;
    this.levelSamples = 0;
  }

  isOnset(t, peak) {
    if (peak < this.high) return false;
    const h = this.history;
    if (!h.length || h[0][0] > t - this.quietSeconds - this.rampSeconds + 0.01) return false; // not enough history yet
    for (const [ht, hp] of h) {
      if (ht >= t - this.rampSeconds ? hp >= this.high : hp >= this.low) return false;
    }
    return true;
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || channels.length === 0) return true;
    const x = channels[0];
    let peak = 0;
    let first = -1;
    for (let i = 0; i < x.length; i++) {
      const a = Math.abs(x[i]);
      if (a > peak) peak = a;
      if (first < 0 && a >= this.high) first = i;
    }
    const t = currentTime;
    if (this.isOnset(t, peak)) this.port.postMessage({ type: "onset", time: t + first / sampleRate, peak });
    this.history.push([t, peak]);
    while (this.history.length && this.history[0][0] < t - this.quietSeconds - this.rampSeconds) this.history.shift();
    this.levelPeak = Math.max(this.levelPeak, peak);
    this.levelSamples += x.length;
    if (this.levelSamples >= sampleRate / 20) {
      this.port.postMessage({ type: "level", time: t, peak: this.levelPeak });
      this.levelPeak = 0;
      this.levelSamples = 0;
    }
    return true;
  }
}

registerProcessor("onset-detector", OnsetDetector);
