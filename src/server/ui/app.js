// The try-it page: choose a face (photo or clip) and speech (a file or the microphone), then
// watch POST /v1/lipsync play through Media Source Extensions while the server is still making
// it. Plain JavaScript, no dependencies; every request goes to this server.
"use strict";

const $ = (id) => document.getElementById(id);
const AVATARS_KEY = "lipsync.avatars";
const KEY_KEY = "lipsync.apiKey";

const state = {
  info: null,
  // What the face comes from: {kind: "image"|"video", file, width, height, detected}
  // or {kind: "avatar", avatar}.
  face: null,
  audio: null, // {blob, name}
  busy: false,
  recorder: null,
  run: null, // the current render (for stats and cancelling)
};

// ---------------------------------------------------------------- requests and errors

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

// The API's message for a failed response: `error` from its JSON body, else the status line.
async function apiError(res) {
  let text = "";
  try {
    text = await res.text();
    const body = JSON.parse(text);
    if (body && typeof body.error === "string") return body.error;
  } catch (_) {
    // not JSON: fall through
  }
  return `${res.status} ${res.statusText}${text ? ": " + text.slice(0, 200) : ""}`;
}

async function api(method, path, body) {
  const res = await fetch(path, { method, body, headers: authHeaders() });
  if (!res.ok) throw new Error(await apiError(res));
  return res.status === 204 ? null : res.json();
}

function showError(message) {
  const el = $("error");
  el.textContent = message;
  el.hidden = !message;
}

function setStatus(id, message, bad = false) {
  const el = $(id);
  el.textContent = message;
  el.classList.toggle("bad", bad);
}

// ---------------------------------------------------------------- server info and key

async function loadInfo() {
  try {
    const res = await fetch("/info");
    if (!res.ok) throw new Error(await apiError(res));
    const info = await res.json();
    state.info = info;
    const parts = [`lipsync ${info.version}`, `${info.device} ${info.dtype}`];
    if (info.random_weights) parts.push("random weights: the mouth will be noise");
    $("server-info").textContent = parts.join(" · ");
    // The enhancers the server loaded: offered beside the face, and only those.
    const enhancers = Array.isArray(info.enhancers) ? info.enhancers : [];
    for (const e of enhancers) {
      const opt = document.createElement("option");
      opt.value = e.name;
      // Real-ESRGAN sharpens the generated mouth (x2, x4); GFPGAN restores the lower face.
      const what = e.applies_to === "aligned_face" ? "restores the face" : `x${e.scale}`;
      const cost = e.ms_per_face >= 1000 ? `, ${(e.ms_per_face / 1000).toFixed(1)} s a face` : "";
      opt.textContent = `${e.name} (${e.kind}, ${what}${cost})`;
      $("enhance").append(opt);
    }
    $("enhance-row").hidden = enhancers.length === 0;
    if (info.auth) {
      $("key-row").hidden = false;
      $("api-key").value = sessionStorage.getItem(KEY_KEY) || "";
    }
  } catch (e) {
    $("server-info").textContent = "cannot read /info: " + e.message;
  }
}

// ---------------------------------------------------------------- face preview and box

const canvas = () => $("face-canvas");

function parseBox(text) {
  const m = /^\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*$/.exec(text);
  if (!m) return null;
  const b = m.slice(1).map(Number);
  return b[2] > b[0] && b[3] > b[1] ? b : null;
}

// Draws the preview picture (kept in state.face.picture) and the box, scaled to the canvas.
function drawPreview() {
  const face = state.face;
  const c = canvas();
  const ctx = c.getContext("2d");
  if (!face || !face.picture) return;
  ctx.drawImage(face.picture, 0, 0, c.width, c.height);
  const box = parseBox($("box").value) || (face.kind === "avatar" ? face.avatar.box : null);
  if (!box) return;
  const sx = c.width / face.width;
  const sy = c.height / face.height;
  ctx.lineWidth = Math.max(2, c.width / 200);
  ctx.strokeStyle = "#22c55e";
  ctx.strokeRect(box[0] * sx, box[1] * sy, (box[2] - box[0]) * sx, (box[3] - box[1]) * sy);
}

// Sizes the canvas to the picture (at most 640 wide) and shows it.
function showPicture(picture, width, height) {
  const c = canvas();
  const scale = Math.min(1, 640 / width);
  c.width = Math.max(1, Math.round(width * scale));
  c.height = Math.max(1, Math.round(height * scale));
  state.face.picture = picture;
  state.face.width = width;
  state.face.height = height;
  $("preview").hidden = false;
  drawPreview();
}

function loadImage(url) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve(img);
    img.onerror = () => reject(new Error("the browser cannot show this picture"));
    img.src = url;
  });
}

// The first frame of a clip, as a canvas.
function firstFrame(url) {
  return new Promise((resolve, reject) => {
    const v = document.createElement("video");
    v.muted = true;
    v.preload = "auto";
    v.onloadeddata = () => {
      const c = document.createElement("canvas");
      c.width = v.videoWidth;
      c.height = v.videoHeight;
      c.getContext("2d").drawImage(v, 0, 0);
      resolve(c);
    };
    v.onerror = () => reject(new Error("the browser cannot show this clip"));
    v.src = url;
  });
}

// `promise`, or an error after `ms`.
function withDeadline(promise, ms, message) {
  let timer;
  const late = new Promise((_, reject) => { timer = setTimeout(() => reject(new Error(message)), ms); });
  return Promise.race([promise, late]).finally(() => clearTimeout(timer));
}

async function chooseFace(file) {
  showError("");
  setStatus("face-status", "");
  $("keep-avatar").hidden = true;
  if (!file) return;
  const url = URL.createObjectURL(file);
  const kind = file.type.startsWith("video/") ? "video" : "image";
  $("box").value = "";
  markCurrentAvatar(null);
  state.face = { kind, file };
  // Finding the face is creating an avatar: the server keeps it (a clip's every frame), and
  // the page reuses its id. It starts at once: the preview never holds it up.
  setStatus("face-status", kind === "video" ? "finding the face in every frame…" : "finding the face…");
  const form = new FormData();
  form.append(kind, file, file.name);
  const found = api("POST", "/v1/avatars", form);
  found.catch(() => {}); // awaited below
  let picture = null;
  try {
    picture = await withDeadline(kind === "video" ? firstFrame(url) : loadImage(url), 15_000, "no preview");
    if (state.face.file !== file) return; // another file was chosen meanwhile
    showPicture(picture, picture.naturalWidth || picture.width, picture.naturalHeight || picture.height);
  } catch (e) {
    // The server may still read it (it decides); no preview.
    if (state.face.file !== file) return;
    picture = null;
    $("preview").hidden = true;
  }
  try {
    const avatar = await found;
    if (state.face.file !== file) return; // another file was chosen meanwhile
    state.face.detected = avatar;
    $("box").value = avatar.box.join(",");
    drawPreview();
    const clip = avatar.kind === "video" ? `, a clip of ${avatar.frames} frames at ${+avatar.fps.toFixed(3)} fps` : "";
    setStatus("face-status", `face at ${avatar.box.join(",")} in ${avatar.width}×${avatar.height}${clip}; kept as avatar ${avatar.id.slice(0, 12)}`);
    rememberAvatar(avatar, picture ? thumbnail(picture, state.face.width, state.face.height) : "", file.name);
    markCurrentAvatar(avatar.id);
  } catch (e) {
    if (state.face.file !== file) return;
    setStatus("face-status", e.message, true);
  }
}

function boxChanged() {
  drawPreview();
  const face = state.face;
  const box = parseBox($("box").value);
  const isFile = face && face.kind !== "avatar";
  const detected = isFile && face.detected;
  const same = detected && box && box.join(",") === detected.box.join(",");
  $("keep-avatar").hidden = !(isFile && box && !same);
  if (isFile) markCurrentAvatar(same || (!box && detected) ? detected.id : null);
}

function setupBoxDrawing() {
  const c = canvas();
  let start = null;
  const at = (ev) => {
    const r = c.getBoundingClientRect();
    const f = state.face;
    const x = ((ev.clientX - r.left) / r.width) * f.width;
    const y = ((ev.clientY - r.top) / r.height) * f.height;
    return [Math.round(Math.min(Math.max(x, 0), f.width)), Math.round(Math.min(Math.max(y, 0), f.height))];
  };
  c.addEventListener("pointerdown", (ev) => {
    if (!state.face || state.face.kind === "avatar" || state.busy) return;
    start = at(ev);
    c.setPointerCapture(ev.pointerId);
  });
  c.addEventListener("pointermove", (ev) => {
    if (!start) return;
    const p = at(ev);
    const b = [Math.min(start[0], p[0]), Math.min(start[1], p[1]), Math.max(start[0], p[0]), Math.max(start[1], p[1])];
    if (b[2] - b[0] >= 4 && b[3] - b[1] >= 4) {
      $("box").value = b.join(",");
      boxChanged();
    }
  });
  const end = () => { start = null; };
  c.addEventListener("pointerup", end);
  c.addEventListener("pointercancel", end);
  $("box").addEventListener("input", boxChanged);
}

// ---------------------------------------------------------------- avatars kept in the browser

function storedAvatars() {
  try {
    const list = JSON.parse(localStorage.getItem(AVATARS_KEY) || "[]");
    return Array.isArray(list) ? list : [];
  } catch (_) {
    return [];
  }
}

function storeAvatars(list) {
  localStorage.setItem(AVATARS_KEY, JSON.stringify(list));
}

function thumbnail(picture, width, height) {
  const scale = Math.min(1, 240 / Math.max(width, height));
  const c = document.createElement("canvas");
  c.width = Math.max(1, Math.round(width * scale));
  c.height = Math.max(1, Math.round(height * scale));
  c.getContext("2d").drawImage(picture, 0, 0, c.width, c.height);
  return c.toDataURL("image/jpeg", 0.85);
}

function rememberAvatar(avatar, thumb, name) {
  const list = storedAvatars().filter((a) => a.id !== avatar.id);
  list.unshift({ id: avatar.id, kind: avatar.kind || "image", box: avatar.box, width: avatar.width, height: avatar.height, thumb, name });
  storeAvatars(list);
  renderAvatars();
}

function markCurrentAvatar(id) {
  for (const li of $("avatars").children) li.classList.toggle("current", li.dataset.id === id);
}

function renderAvatars() {
  const list = storedAvatars();
  const ul = $("avatars");
  const current = state.face && (state.face.kind === "avatar" ? state.face.avatar.id : state.face.detected && state.face.detected.id);
  ul.replaceChildren();
  $("avatars-empty").hidden = list.length > 0;
  for (const a of list) {
    const li = document.createElement("li");
    li.dataset.id = a.id;
    li.classList.toggle("current", a.id === current);
    if (a.thumb) {
      const img = document.createElement("img");
      img.src = a.thumb;
      img.alt = a.name || "avatar";
      li.append(img);
    }
    const label = document.createElement("code");
    label.textContent = `${a.kind === "video" ? "clip" : "photo"} ${a.id.slice(0, 12)} · ${a.box.join(",")}`;
    label.title = `${a.name || ""} ${a.id}`;
    const actions = document.createElement("div");
    actions.className = "actions";
    const use = document.createElement("button");
    use.type = "button";
    use.textContent = "Use";
    use.className = "use";
    use.addEventListener("click", () => useAvatar(a));
    const del = document.createElement("button");
    del.type = "button";
    del.textContent = "Delete";
    del.className = "delete secondary";
    del.addEventListener("click", () => deleteAvatar(a));
    actions.append(use, del);
    li.append(label, actions);
    ul.append(li);
  }
}

async function useAvatar(a) {
  showError("");
  try {
    await api("GET", "/v1/avatars/" + encodeURIComponent(a.id));
  } catch (e) {
    setStatus("face-status", e.message, true);
    const li = [...$("avatars").children].find((x) => x.dataset.id === a.id);
    if (li) li.classList.add("gone");
    return;
  }
  $("face-file").value = "";
  $("box").value = "";
  $("keep-avatar").hidden = true;
  state.face = { kind: "avatar", avatar: a };
  setStatus("face-status", `avatar ${a.id.slice(0, 12)} (${a.name || a.kind || "photo"}), face at ${a.box.join(",")}`);
  if (a.thumb) {
    try {
      const img = await loadImage(a.thumb);
      showPicture(img, a.width, a.height);
    } catch (_) {
      $("preview").hidden = true;
    }
  } else {
    $("preview").hidden = true;
  }
  markCurrentAvatar(a.id);
}

async function deleteAvatar(a) {
  showError("");
  try {
    await api("DELETE", "/v1/avatars/" + encodeURIComponent(a.id));
  } catch (e) {
    // Already gone from the server (evicted, deleted, restarted): forget it here too.
    setStatus("face-status", e.message, true);
  }
  storeAvatars(storedAvatars().filter((x) => x.id !== a.id));
  if (state.face && state.face.kind === "avatar" && state.face.avatar.id === a.id) {
    state.face = null;
    $("preview").hidden = true;
  }
  if (state.face && state.face.detected && state.face.detected.id === a.id) state.face.detected = null;
  renderAvatars();
}

async function keepAvatar() {
  const face = state.face;
  const box = parseBox($("box").value);
  if (!face || face.kind === "avatar" || !box) return;
  const form = new FormData();
  form.append(face.kind, face.file, face.file.name);
  form.append("box", box.join(","));
  try {
    const avatar = await api("POST", "/v1/avatars", form);
    face.detected = avatar;
    rememberAvatar(avatar, thumbnail(face.picture, face.width, face.height), face.file.name);
    boxChanged();
    setStatus("face-status", `kept as avatar ${avatar.id.slice(0, 12)} with the box ${avatar.box.join(",")}`);
  } catch (e) {
    setStatus("face-status", e.message, true);
  }
}

// ---------------------------------------------------------------- speech: file or microphone

function chooseAudio(blob, name) {
  state.audio = blob ? { blob, name } : null;
  const player = $("audio-preview");
  if (player.src) URL.revokeObjectURL(player.src);
  if (blob) {
    player.src = URL.createObjectURL(blob);
    player.hidden = false;
  } else {
    player.removeAttribute("src");
    player.hidden = true;
  }
}

// Collects the microphone's samples on the audio thread and posts them to the page.
const CAPTURE_WORKLET = `
registerProcessor("pcm-capture", class extends AudioWorkletProcessor {
  process(inputs) {
    const input = inputs[0];
    if (input && input[0]) this.port.postMessage(input[0].slice(0));
    return true;
  }
});`;

// 16-bit PCM WAV, mono.
function encodeWav(chunks, rate) {
  const n = chunks.reduce((s, c) => s + c.length, 0);
  const buf = new ArrayBuffer(44 + n * 2);
  const v = new DataView(buf);
  const text = (at, s) => { for (let i = 0; i < s.length; i++) v.setUint8(at + i, s.charCodeAt(i)); };
  text(0, "RIFF");
  v.setUint32(4, 36 + n * 2, true);
  text(8, "WAVE");
  text(12, "fmt ");
  v.setUint32(16, 16, true);
  v.setUint16(20, 1, true); // PCM
  v.setUint16(22, 1, true); // mono
  v.setUint32(24, rate, true);
  v.setUint32(28, rate * 2, true);
  v.setUint16(32, 2, true);
  v.setUint16(34, 16, true);
  text(36, "data");
  v.setUint32(40, n * 2, true);
  let at = 44;
  for (const c of chunks) {
    for (let i = 0; i < c.length; i++, at += 2) {
      const s = Math.max(-1, Math.min(1, c[i]));
      v.setInt16(at, s < 0 ? s * 0x8000 : s * 0x7fff, true);
    }
  }
  return new Blob([buf], { type: "audio/wav" });
}

async function startRecording() {
  showError("");
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
    });
  } catch (e) {
    setStatus("audio-status", "no microphone: " + e.message, true);
    return;
  }
  const ctx = new AudioContext();
  const workletUrl = URL.createObjectURL(new Blob([CAPTURE_WORKLET], { type: "text/javascript" }));
  try {
    await ctx.audioWorklet.addModule(workletUrl);
  } finally {
    URL.revokeObjectURL(workletUrl);
  }
  const source = ctx.createMediaStreamSource(stream);
  const node = new AudioWorkletNode(ctx, "pcm-capture", { channelCount: 1, channelCountMode: "explicit" });
  const chunks = [];
  node.port.onmessage = (ev) => chunks.push(ev.data);
  source.connect(node);
  const limit = (state.info && state.info.limits && state.info.limits.max_audio_seconds) || 60;
  const started = performance.now();
  const rec = { ctx, stream, node, source, chunks, rate: ctx.sampleRate, started };
  rec.timer = setInterval(() => {
    const s = (performance.now() - started) / 1000;
    setStatus("audio-status", `recording… ${s.toFixed(1)} s (up to ${limit} s)`);
    if (s >= limit) stopRecording();
  }, 100);
  state.recorder = rec;
  $("record").textContent = "Stop";
  $("record").classList.add("recording");
}

async function stopRecording() {
  const rec = state.recorder;
  if (!rec) return;
  state.recorder = null;
  clearInterval(rec.timer);
  rec.source.disconnect();
  rec.node.port.onmessage = null;
  rec.stream.getTracks().forEach((t) => t.stop());
  await rec.ctx.close();
  $("record").textContent = "Record";
  $("record").classList.remove("recording");
  const samples = rec.chunks.reduce((s, c) => s + c.length, 0);
  if (samples === 0) {
    setStatus("audio-status", "the microphone gave no sound", true);
    return;
  }
  $("audio-file").value = "";
  chooseAudio(encodeWav(rec.chunks, rec.rate), "recording.wav");
  setStatus("audio-status", `recorded ${(samples / rec.rate).toFixed(1)} s at ${rec.rate} Hz (16-bit WAV)`);
}

// ---------------------------------------------------------------- fragmented MP4 reading

// Walks the boxes of `bytes[start, end)`, calling fn(type, contentStart, boxEnd).
function boxes(bytes, start, end, fn) {
  const v = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let at = start;
  while (at + 8 <= end) {
    let size = v.getUint32(at);
    const type = String.fromCharCode(bytes[at + 4], bytes[at + 5], bytes[at + 6], bytes[at + 7]);
    let header = 8;
    if (size === 1) {
      if (at + 16 > end) return;
      size = Number(v.getBigUint64(at + 8));
      header = 16;
    } else if (size === 0) {
      size = end - at;
    }
    if (size < header || at + size > end) return;
    fn(type, at + header, at + size, v);
    at += size;
  }
}

// One box's children: {type: [contentStart, end]} (first of each type).
function children(bytes, start, end) {
  const out = {};
  boxes(bytes, start, end, (type, s, e) => { if (!out[type]) out[type] = [s, e]; });
  return out;
}

const hex2 = (n) => n.toString(16).padStart(2, "0");

// Length of an MPEG-4 descriptor size field, and the size.
function descriptorSize(bytes, at) {
  let size = 0;
  for (let i = 0; i < 4; i++) {
    const b = bytes[at + i];
    size = (size << 7) | (b & 0x7f);
    if (!(b & 0x80)) return [i + 1, size];
  }
  return [4, size];
}

// The AAC object type from an esds box's content, e.g. 2 for AAC LC.
function aacObjectType(bytes, start, end) {
  let at = start + 4; // version and flags
  while (at < end) {
    const tag = bytes[at];
    const [n] = descriptorSize(bytes, at + 1);
    at += 1 + n;
    if (tag === 3) {
      const flags = bytes[at + 2];
      at += 3;
      if (flags & 0x80) at += 2;
      if (flags & 0x40) at += 1 + bytes[at];
      if (flags & 0x20) at += 2;
    } else if (tag === 4) {
      at += 13;
    } else if (tag === 5) {
      return bytes[at] >> 3;
    } else {
      return null;
    }
  }
  return null;
}

// From the init segment: the tracks (id → {kind, timescale, codec, defaultDuration}).
function readInit(bytes, moovStart, moovEnd) {
  const tracks = {};
  const defaults = {};
  boxes(bytes, moovStart, moovEnd, (type, s, e, v) => {
    if (type === "mvex") {
      boxes(bytes, s, e, (t, ts, te) => {
        if (t === "trex") defaults[v.getUint32(ts + 4)] = v.getUint32(ts + 12);
      });
    }
    if (type !== "trak") return;
    const trak = children(bytes, s, e);
    if (!trak.tkhd || !trak.mdia) return;
    const tkhd = trak.tkhd[0];
    const id = v.getUint32(tkhd + (bytes[tkhd] === 1 ? 20 : 12));
    const mdia = children(bytes, ...trak.mdia);
    if (!mdia.mdhd || !mdia.hdlr || !mdia.minf) return;
    const mdhd = mdia.mdhd[0];
    const timescale = v.getUint32(mdhd + (bytes[mdhd] === 1 ? 20 : 12));
    const handler = String.fromCharCode(...bytes.subarray(mdia.hdlr[0] + 8, mdia.hdlr[0] + 12));
    const minf = children(bytes, ...mdia.minf);
    const stbl = minf.stbl && children(bytes, ...minf.stbl);
    let codec = null;
    if (stbl && stbl.stsd) {
      boxes(bytes, stbl.stsd[0] + 8, stbl.stsd[1], (entry, es, ee) => {
        if (codec) return;
        if (entry === "avc1" || entry === "avc3") {
          const c = children(bytes, es + 78, ee);
          if (c.avcC) {
            const a = c.avcC[0];
            codec = entry + "." + hex2(bytes[a + 1]) + hex2(bytes[a + 2]) + hex2(bytes[a + 3]);
          }
        } else if (entry === "mp4a") {
          const c = children(bytes, es + 28, ee);
          const aot = c.esds ? aacObjectType(bytes, ...c.esds) : null;
          codec = "mp4a.40." + (aot || 2);
        } else {
          codec = entry;
        }
      });
    }
    tracks[id] = { kind: handler === "vide" ? "video" : handler === "soun" ? "audio" : handler, timescale, codec };
  });
  for (const id in tracks) tracks[id].defaultDuration = defaults[id] || 0;
  return tracks;
}

// From a moof: the video samples and their total duration in seconds.
function readFragment(bytes, start, end, tracks) {
  let frames = 0;
  let seconds = 0;
  boxes(bytes, start, end, (type, s, e, v) => {
    if (type !== "traf") return;
    const traf = children(bytes, s, e);
    if (!traf.tfhd) return;
    const tf = traf.tfhd[0];
    const tfFlags = v.getUint32(tf) & 0xffffff;
    const track = tracks[v.getUint32(tf + 4)];
    if (!track || track.kind !== "video") return;
    let at = tf + 8;
    if (tfFlags & 0x01) at += 8;
    if (tfFlags & 0x02) at += 4;
    let duration = track.defaultDuration;
    if (tfFlags & 0x08) duration = v.getUint32(at);
    boxes(bytes, s, e, (t, rs) => {
      if (t !== "trun") return;
      const flags = v.getUint32(rs) & 0xffffff;
      const count = v.getUint32(rs + 4);
      let p = rs + 8;
      if (flags & 0x01) p += 4;
      if (flags & 0x04) p += 4;
      const per = ((flags & 0x100) ? 4 : 0) + ((flags & 0x200) ? 4 : 0) + ((flags & 0x400) ? 4 : 0) + ((flags & 0x800) ? 4 : 0);
      let ticks = 0;
      for (let i = 0; i < count; i++) ticks += (flags & 0x100) ? v.getUint32(p + i * per) : duration;
      frames += count;
      if (track.timescale) seconds += ticks / track.timescale;
    });
  });
  return { frames, seconds };
}

// Splits a growing byte stream into whole top-level boxes.
class BoxSplitter {
  constructor() {
    this.pending = new Uint8Array(0);
  }
  push(chunk) {
    const all = new Uint8Array(this.pending.length + chunk.length);
    all.set(this.pending);
    all.set(chunk, this.pending.length);
    const out = [];
    let at = 0;
    const v = new DataView(all.buffer);
    while (at + 8 <= all.length) {
      let size = v.getUint32(at);
      if (size === 1) {
        if (at + 16 > all.length) break;
        size = Number(v.getBigUint64(at + 8));
      }
      if (size < 8) throw new Error("the stream is not an MP4");
      if (at + size > all.length) break;
      const type = String.fromCharCode(all[at + 4], all[at + 5], all[at + 6], all[at + 7]);
      out.push({ type, bytes: all.subarray(at, at + size) });
      at += size;
    }
    this.pending = all.slice(at);
    return out;
  }
}

// ---------------------------------------------------------------- playing the stream

// Appends to a SourceBuffer one piece at a time.
class Appender {
  constructor(sourceBuffer) {
    this.sb = sourceBuffer;
    this.queue = [];
    this.failed = null;
    this.idle = [];
    sourceBuffer.addEventListener("updateend", () => this.next());
    sourceBuffer.addEventListener("error", () => { this.failed = new Error("the browser could not decode the video"); });
  }
  push(bytes) {
    this.queue.push(bytes);
    this.next();
  }
  next() {
    if (this.sb.updating) return;
    if (this.failed) return this.finish();
    const bytes = this.queue.shift();
    if (!bytes) return this.finish();
    try {
      if (bytes.remove) this.sb.remove(...bytes.remove);
      else this.sb.appendBuffer(bytes);
    } catch (e) {
      this.failed = e;
      this.finish();
    }
  }
  finish() {
    if (this.sb.updating || (this.queue.length && !this.failed)) return;
    const waiting = this.idle;
    this.idle = [];
    waiting.forEach((f) => f());
  }
  // Drops [start, end) seconds of what is buffered, in turn with the appends.
  remove(start, end) {
    if (end > start) this.push({ remove: [start, end] });
  }
  // Resolves when everything pushed so far is appended.
  drained() {
    return new Promise((resolve, reject) => {
      const done = () => (this.failed ? reject(this.failed) : resolve());
      if (!this.sb.updating && !this.queue.length) return done();
      this.idle.push(done);
    });
  }
}

function setBusy(busy) {
  state.busy = busy;
  $("generate").disabled = busy;
  document.body.dataset.state = busy ? "streaming" : document.body.dataset.state;
}

function updateStats(run) {
  const now = performance.now();
  $("ttff").textContent = run.firstFrameAt ? `${((run.firstFrameAt - run.started) / 1000).toFixed(2)} s` : "–";
  // "n of N" when the server said how many frames the video holds (X-Video-Frames).
  $("frames").textContent = run.total ? `${run.frames} of ${run.total}` : String(run.frames);
  if (run.firstFrameAt && run.frames > 0) {
    const wall = ((run.doneAt || now) - run.started) / 1000;
    const fps = run.frames / wall;
    const realtime = run.seconds / wall;
    $("speed").textContent = `${fps.toFixed(1)} frames/s (${realtime.toFixed(2)}× real time)`;
  }
}

function requestForm() {
  const face = state.face;
  if (!face) throw new Error("choose a photo or clip, or one of your avatars");
  if (!state.audio) throw new Error("choose an audio file or record some speech");
  const form = new FormData();
  form.append("audio", state.audio.blob, state.audio.name);
  const box = parseBox($("box").value);
  if ($("box").value.trim() && !box) throw new Error("the face box is x1,y1,x2,y2 in pixels, x2 > x1 and y2 > y1");
  if (face.kind === "avatar") {
    form.append("avatar_id", face.avatar.id);
  } else if (face.detected && (!box || box.join(",") === face.detected.box.join(","))) {
    // The file's prepared avatar: no second face detection.
    form.append("avatar_id", face.detected.id);
  } else {
    form.append(face.kind, face.file, face.file.name);
    if (box) form.append("box", box.join(","));
  }
  if ($("enhance").value !== "none") form.append("enhance", $("enhance").value);
  return form;
}

async function generate() {
  if (state.busy) return;
  showError("");
  let form;
  try {
    form = requestForm();
  } catch (e) {
    showError(e.message);
    return;
  }
  if (state.recorder) await stopRecording();
  const video = $("output");
  const download = $("download");
  if (download.href.startsWith("blob:")) URL.revokeObjectURL(download.href);
  download.hidden = true;
  if (video.src) URL.revokeObjectURL(video.src);
  const run = { started: performance.now(), firstFrameAt: 0, doneAt: 0, frames: 0, seconds: 0, parts: [] };
  state.run = run;
  window.lipsyncRun = run; // for the browser tests and the curious
  updateStats(run);
  $("stats").hidden = true;
  setBusy(true);
  try {
    const res = await fetch("/v1/lipsync", { method: "POST", body: form, headers: authHeaders() });
    if (!res.ok) throw new Error(await apiError(res));
    run.total = Number(res.headers.get("x-video-frames")) || 0;
    $("stats").hidden = false;
    await play(res, run, video);
    run.doneAt = performance.now();
    updateStats(run);
    download.href = URL.createObjectURL(new Blob(run.parts, { type: "video/mp4" }));
    download.hidden = false;
    document.body.dataset.state = "done";
  } catch (e) {
    showError(e.message);
    document.body.dataset.state = "error";
  } finally {
    setBusy(false);
  }
}

// Feeds the response into the video element through MSE while it arrives.
async function play(res, run, video) {
  const type = (res.headers.get("content-type") || "").split(";")[0].trim();
  if (type !== "video/mp4") throw new Error(`the server answered ${type || "no content type"}, not video/mp4`);
  const ms = new MediaSource();
  video.src = URL.createObjectURL(ms);
  video.hidden = false;
  await new Promise((resolve) => ms.addEventListener("sourceopen", resolve, { once: true }));
  const reader = res.body.getReader();
  const splitter = new BoxSplitter();
  let appender = null;
  let init = [];
  let tracks = null;
  let started = false;
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (e) {
      // The server aborts the connection when the video cannot be completed.
      throw new Error(`the stream was cut off after ${run.frames} frames: the server could not finish the video (${e.message})`);
    }
    if (chunk.done) break;
    run.parts.push(chunk.value);
    for (const box of splitter.push(chunk.value)) {
      if (!appender) {
        init.push(box.bytes);
        if (box.type !== "moov") continue;
        tracks = readInit(box.bytes, 8, box.bytes.length);
        const codecs = Object.values(tracks).map((t) => t.codec).filter(Boolean);
        const mime = `video/mp4; codecs="${codecs.join(",")}"`;
        if (!MediaSource.isTypeSupported(mime)) throw new Error(`this browser cannot play ${mime}`);
        appender = new Appender(ms.addSourceBuffer(mime));
        init.forEach((b) => appender.push(b));
        init = null;
        continue;
      }
      if (box.type === "moof") {
        const f = readFragment(box.bytes, 8, box.bytes.length, tracks);
        run.pendingFrames = f;
      }
      appender.push(box.bytes);
      if (box.type === "mdat" && run.pendingFrames) {
        // A whole fragment (moof + mdat) is here.
        run.frames += run.pendingFrames.frames;
        run.seconds += run.pendingFrames.seconds;
        if (run.pendingFrames.frames && !run.firstFrameAt) run.firstFrameAt = performance.now();
        run.pendingFrames = null;
        updateStats(run);
        if (!started && run.frames) {
          started = true;
          video.play().catch(() => {}); // a browser that wants a click shows the controls
        }
      }
    }
  }
  if (!appender) throw new Error("the stream ended before the video started");
  if (splitter.pending.length) throw new Error("the stream ended inside an MP4 box");
  await appender.drained();
  if (ms.readyState === "open") ms.endOfStream();
}

// ---------------------------------------------------------------- live mode: microphone → /v1/stream

// The server ends an utterance after --utterance-gap-ms (300 by default) without audio. The
// voice gate keeps sending for longer than that after the voice drops below it, so a pause
// inside a phrase never splits it (or leaves the drawing waiting for audio that never comes).
const LIVE_CHUNK_MS = 20;
const LIVE_HANGOVER_MS = 400;
const LIVE_PREROLL_CHUNKS = 10; // 200 ms before the gate opens: the phrase's first sound
const LIVE_GAP_MS = 300;
// Playback behind the newest frame catches up by playing faster (so that no speaking frame is
// skipped), or by jumping ahead when far behind (a tab that was in the background).
const LIVE_FAST_BEHIND_S = 0.4;
const LIVE_JUMP_BEHIND_S = 3;

// Cuts the microphone into 20 ms blocks of 16-bit PCM on the audio thread, with their level.
const LIVE_WORKLET = `
registerProcessor("pcm-live", class extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.size = options.processorOptions.size;
    this.buf = new Float32Array(this.size);
    this.n = 0;
  }
  process(inputs) {
    const ch = inputs[0] && inputs[0][0];
    if (!ch) return true;
    let i = 0;
    while (i < ch.length) {
      const take = Math.min(ch.length - i, this.size - this.n);
      this.buf.set(ch.subarray(i, i + take), this.n);
      this.n += take;
      i += take;
      if (this.n < this.size) break;
      const pcm = new Int16Array(this.size);
      let sum = 0;
      for (let j = 0; j < this.size; j++) {
        const s = Math.max(-1, Math.min(1, this.buf[j]));
        sum += s * s;
        pcm[j] = s < 0 ? s * 0x8000 : s * 0x7fff;
      }
      this.port.postMessage({ pcm: pcm.buffer, rms: Math.sqrt(sum / this.size) }, [pcm.buffer]);
      this.n = 0;
    }
    return true;
  }
});`;

function setLiveButtons(running) {
  $("live-start").disabled = running;
  $("live-clear").disabled = !running;
  $("live-stop").disabled = !running;
  $("live-fps").disabled = running;
  $("live-min-draw").disabled = running;
}

// The avatar the session speaks with: the chosen one, the photo's own, or a new one for a box
// typed or drawn but not kept yet.
async function liveAvatarId() {
  const face = state.face;
  if (!face) throw new Error("choose a photo (step 1) or one of your avatars first");
  if (face.kind === "avatar") return face.avatar.id;
  const box = parseBox($("box").value);
  if (face.detected && (!box || box.join(",") === face.detected.box.join(","))) return face.detected.id;
  if (!box) throw new Error("no face found in this picture: draw or type the face box");
  await keepAvatar();
  if (!face.detected) throw new Error($("face-status").textContent || "the avatar could not be made");
  return face.detected.id;
}

function liveUrl() {
  const key = $("api-key").value.trim();
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  // Browsers cannot set headers on a WebSocket: the key goes in the query.
  return `${scheme}//${location.host}/v1/stream${key ? "?api_key=" + encodeURIComponent(key) : ""}`;
}

const ms = (s) => `${Math.round(s * 1000)} ms`;

function updateLive(L) {
  const act = $("live-activity");
  // The server's state runs ahead of the picture by the frames buffered: both are shown.
  act.textContent = (L.activity || "–") + (L.shownActivity ? ` (on screen: ${L.shownActivity})` : "");
  act.classList.toggle("speaking", L.activity === "speaking");
  // The newest utterance on screen (else the newest received).
  const u = L.utterances.filter((x) => x.shownAt).pop() || L.utterances.filter((x) => x.receivedAt).pop();
  if (u) {
    const shown = u.shownAt ? `, on screen after ${ms((u.shownAt - u.sentAt) / 1000)}` : "";
    $("live-latency").textContent = `received after ${ms((u.receivedAt - u.sentAt) / 1000)}${shown} (utterance ${L.utterances.indexOf(u) + 1})`;
  }
  // Drawn vs held speaking frames, as the server counted them at its last event (or the end).
  const counts = L.endStats || L.counts;
  const held = counts ? `; ${counts.drawn_frames} drawn, ${counts.held_frames} held (server)` : "";
  $("live-frames").textContent = `${L.frames} received, ${L.speakingShown} speaking frames shown${held}`;
  $("live-late").textContent = L.endStats ? `${L.endStats.late_frames} (server), ${L.late} as received` : `${L.late} as received`;
  $("live-behind").textContent = L.behind == null ? "–" : ms(L.behind);
  if (L.endStats) {
    const s = L.endStats;
    const p = (v) => (v == null ? "–" : `${Math.round(v)} ms`);
    $("live-server").textContent = `latency p50 ${p(s.latency_ms_p50)}, p95 ${p(s.latency_ms_p95)}; ` +
      `${s.frames} frames (${s.speaking_frames} speaking, ${s.idle_frames} idle), ` +
      `${s.utterances} utterances, ${s.interrupted} interrupted, most late ${p(s.max_lateness_ms)}`;
  }
}

// The level of one 20 ms block decides whether it is sent.
function liveChunk(L, pcm, rms) {
  const db = rms > 0 ? 20 * Math.log10(rms) : -100;
  L.level = db;
  const loud = db >= Number($("live-gate").value);
  const now = performance.now();
  if (L.muted) {
    // After an interrupt: nothing is sent until the voice pauses.
    L.mutedQuiet = loud ? 0 : L.mutedQuiet + LIVE_CHUNK_MS;
    if (L.mutedQuiet >= LIVE_HANGOVER_MS) L.muted = false;
  }
  if (!L.open) {
    L.preroll.push(pcm);
    if (L.preroll.length > LIVE_PREROLL_CHUNKS) L.preroll.shift();
    if (!loud || L.muted || !L.ready) return;
    L.open = true;
    L.quiet = 0;
    // A new utterance on the server (its gap passed, or it was cleared): time it from here.
    if (L.fresh || now - L.lastSent > LIVE_GAP_MS) L.utterances.push({ sentAt: now });
    L.fresh = false;
    for (const p of L.preroll) L.ws.send(p);
    L.preroll = [];
    L.lastSent = now;
    return;
  }
  L.ws.send(pcm);
  L.lastSent = now;
  L.quiet = loud ? 0 : L.quiet + LIVE_CHUNK_MS;
  if (L.quiet >= LIVE_HANGOVER_MS) L.open = false;
}

function liveEvent(L, msg) {
  const now = performance.now();
  L.events.push({ ...msg, at: now });
  if (msg.type === "ready") {
    L.ready = msg;
    const mime = msg.mime;
    if (!MediaSource.isTypeSupported(mime)) throw new Error(`this browser cannot play ${mime}`);
    L.appender = new Appender(L.ms.addSourceBuffer(mime));
    // draw_fps: the faces per second the server expects to draw (the rest of the speaking
    // frames repeat the last face drawn).
    const drawing = msg.draw_fps != null && msg.draw_fps < msg.fps ? `, drawing about ${+msg.draw_fps.toFixed(1)} faces/s` : "";
    setStatus("live-status", `live: ${msg.width}×${msg.height} at ${+msg.fps.toFixed(3)} fps${drawing}; speak`);
    $("live-stats").hidden = false;
  } else if (msg.type === "idle" || msg.type === "speaking") {
    L.activity = msg.type;
    if (msg.drawn_frames != null) L.counts = { drawn_frames: msg.drawn_frames, held_frames: msg.held_frames };
    L.ranges.push({ type: msg.type, pts: msg.pts });
    if (msg.type === "speaking") {
      // The first utterance sent and not yet seen speaking.
      const u = L.utterances.find((x) => x.frame == null);
      if (u) {
        u.frame = msg.frame;
        u.pts = msg.pts;
        if (L.frames > msg.frame) u.receivedAt = now;
      }
    }
  } else if (msg.type === "end") {
    L.endStats = msg.stats;
  } else if (msg.type === "error") {
    L.error = msg;
    setStatus("live-status", msg.error, true);
  }
  updateLive(L);
}

function liveFragment(L, data) {
  const now = performance.now();
  for (const box of L.splitter.push(new Uint8Array(data))) {
    if (!L.tracks) {
      if (box.type === "moov") L.tracks = readInit(box.bytes, 8, box.bytes.length);
      L.appender.push(box.bytes);
      continue;
    }
    if (box.type === "moof") L.pending = readFragment(box.bytes, 8, box.bytes.length, L.tracks).frames;
    L.appender.push(box.bytes);
    if (box.type !== "mdat") continue;
    const fps = L.ready.fps;
    for (let i = 0; i < L.pending; i++) {
      // Late as received: later than the earliest schedule seen by more than a frame.
      const k = L.frames + i;
      const offset = now - (k / fps) * 1000;
      L.origin = L.origin == null ? offset : Math.min(L.origin, offset);
      if (offset - L.origin > 1000 / fps) L.late++;
    }
    L.frames += L.pending;
    L.pending = 0;
    for (const u of L.utterances) if (u.frame != null && !u.receivedAt && L.frames > u.frame) u.receivedAt = now;
    if (!L.playing && L.frames > 0) {
      L.playing = true;
      L.video.play().catch(() => {});
    }
  }
  updateLive(L);
}

// Whether pts falls in a speaking stretch (from the events).
function speakingAt(L, pts) {
  let type = "idle";
  for (const r of L.ranges) {
    if (r.pts > pts + 1e-6) break;
    type = r.type;
  }
  return type === "speaking";
}

// Each frame shown: speaking frames counted, the time on screen of an utterance's first frame.
function watchFrames(L) {
  const v = L.video;
  let last = -1;
  const seen = (mediaTime) => {
    if (mediaTime === last) return;
    last = mediaTime;
    const now = performance.now();
    const speaking = speakingAt(L, mediaTime);
    if (speaking) L.speakingShown++;
    L.shownActivity = speaking ? "speaking" : "idle";
    for (const u of L.utterances) if (u.pts != null && !u.shownAt && mediaTime >= u.pts - 1e-3) u.shownAt = now;
    updateLive(L);
  };
  if (v.requestVideoFrameCallback) {
    const cb = (_, meta) => {
      if (state.live && state.live !== L) return; // a newer session owns the element
      seen(meta.mediaTime);
      v.requestVideoFrameCallback(cb);
    };
    v.requestVideoFrameCallback(cb);
  } else {
    v.addEventListener("timeupdate", () => seen(v.currentTime));
  }
  // Stay near the newest frame; keep the last few seconds buffered only.
  L.timer = setInterval(() => {
    const b = v.buffered;
    if (!b.length) return;
    const end = b.end(b.length - 1);
    L.behind = Math.max(0, end - v.currentTime);
    if (!L.closed && L.behind > LIVE_JUMP_BEHIND_S) {
      v.currentTime = end - 0.1;
      L.jumps++;
    }
    else if (!L.closed && L.behind > LIVE_FAST_BEHIND_S) v.playbackRate = 1.25;
    else if (L.closed || L.behind < LIVE_FAST_BEHIND_S / 2) v.playbackRate = 1;
    if (v.currentTime - b.start(0) > 20 && L.appender) L.appender.remove(b.start(0), v.currentTime - 10);
    updateLive(L);
  }, 250);
}

async function startLive() {
  if (state.live) return;
  setStatus("live-status", "");
  let avatarId;
  try {
    avatarId = await liveAvatarId();
  } catch (e) {
    setStatus("live-status", e.message, true);
    return;
  }
  const fps = Number($("live-fps").value) || 25;
  // The fewest faces per second accepted (min_draw_fps; the server's default is 5): on a slow
  // machine a lower one starts a session that would be refused as over capacity.
  const minDraw = Number($("live-min-draw").value);
  const minDrawFps = minDraw > 0 ? Math.min(minDraw, fps) : 5;
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: false, autoGainControl: false },
    });
  } catch (e) {
    setStatus("live-status", "no microphone: " + e.message, true);
    return;
  }
  const L = {
    ws: null, ctx: null, stream, node: null, source: null, ms: new MediaSource(), video: $("live-video"),
    appender: null, splitter: new BoxSplitter(), tracks: null, pending: 0, ready: null, error: null,
    events: [], ranges: [], utterances: [], frames: 0, late: 0, origin: null, speakingShown: 0,
    activity: "connecting", behind: null, jumps: 0, endStats: null, playing: false, closed: false,
    open: false, quiet: 0, preroll: [], muted: false, mutedQuiet: 0, fresh: true, lastSent: -1e9, level: -100,
  };
  state.live = L;
  window.lipsyncLive = L; // for the browser tests and the curious
  setLiveButtons(true);
  const video = L.video;
  if (video.src) URL.revokeObjectURL(video.src);
  video.muted = !$("live-sound").checked;
  video.src = URL.createObjectURL(L.ms);
  video.hidden = false;
  try {
    await new Promise((resolve) => L.ms.addEventListener("sourceopen", resolve, { once: true }));
    L.ctx = new AudioContext();
    const workletUrl = URL.createObjectURL(new Blob([LIVE_WORKLET], { type: "text/javascript" }));
    try {
      await L.ctx.audioWorklet.addModule(workletUrl);
    } finally {
      URL.revokeObjectURL(workletUrl);
    }
    L.source = L.ctx.createMediaStreamSource(stream);
    const size = Math.round((L.ctx.sampleRate * LIVE_CHUNK_MS) / 1000);
    L.node = new AudioWorkletNode(L.ctx, "pcm-live", {
      numberOfOutputs: 0, channelCount: 1, channelCountMode: "explicit", processorOptions: { size },
    });
  } catch (e) {
    stopLiveAudio(L);
    setStatus("live-status", "cannot capture the microphone: " + e.message, true);
    L.closed = true;
    state.live = null;
    setLiveButtons(false);
    return;
  }
  updateLive(L);
  setStatus("live-status", "connecting…");
  const ws = new WebSocket(liveUrl());
  ws.binaryType = "arraybuffer";
  L.ws = ws;
  ws.onopen = () => {
    ws.send(JSON.stringify({
      avatar_id: avatarId, fps,
      audio: { format: "s16le", sample_rate: L.ctx.sampleRate, channels: 1 },
      output: "fmp4", min_draw_fps: minDrawFps,
      ...($("enhance").value !== "none" ? { enhance: $("enhance").value } : {}),
    }));
    L.node.port.onmessage = (ev) => {
      if (ws.readyState === WebSocket.OPEN && !L.stopping) liveChunk(L, ev.data.pcm, ev.data.rms);
      $("live-level").value = Math.max(-80, L.level);
    };
    L.source.connect(L.node);
  };
  ws.onmessage = (ev) => {
    try {
      if (typeof ev.data === "string") liveEvent(L, JSON.parse(ev.data));
      else if (L.appender) liveFragment(L, ev.data);
    } catch (e) {
      setStatus("live-status", e.message, true);
      ws.close(1000);
    }
  };
  ws.onclose = (ev) => finishLive(L, ev);
  watchFrames(L);
}

// Why an upgrade failed: a browser shows a WebSocket nothing of a refused handshake, so the
// same request without the upgrade tells (the API's 401, 403, 429 or 503; 426 when only the
// upgrade was missing).
async function refusal(ev) {
  const closed = `the server refused the session (${ev.code}${ev.reason ? " " + ev.reason : ""})`;
  try {
    const res = await fetch(liveUrl().replace(/^ws/, "http"));
    return res.status === 426 ? closed : await apiError(res);
  } catch (_) {
    return closed;
  }
}

function stopLiveAudio(L) {
  if (L.source) L.source.disconnect();
  if (L.node) L.node.port.onmessage = null;
  L.stream.getTracks().forEach((t) => t.stop());
  if (L.ctx && L.ctx.state !== "closed") L.ctx.close();
}

async function finishLive(L, ev) {
  L.closed = true;
  stopLiveAudio(L);
  clearInterval(L.timer);
  if (state.live === L) state.live = null;
  setLiveButtons(false);
  L.activity = ev.code === 1000 ? "ended" : "closed";
  if (!L.error) {
    if (ev.code === 1000) setStatus("live-status", "ended");
    else if (!L.ready) setStatus("live-status", await refusal(ev), true);
    else setStatus("live-status", `the session closed (${ev.code}${ev.reason ? " " + ev.reason : ""})`, true);
  }
  updateLive(L);
  if (L.appender) {
    try {
      await L.appender.drained();
      if (L.ms.readyState === "open") L.ms.endOfStream();
    } catch (e) {
      setStatus("live-status", e.message, true);
    }
  }
}

function interruptLive() {
  const L = state.live;
  if (!L || !L.ready || L.stopping) return;
  L.ws.send(JSON.stringify({ type: "clear" }));
  L.interrupts = (L.interrupts || 0) + 1;
  // What was said is dropped; the voice that goes on is not sent until it pauses.
  L.open = false;
  L.preroll = [];
  L.muted = true;
  L.mutedQuiet = 0;
  L.fresh = true;
}

function stopLive() {
  const L = state.live;
  if (!L || L.stopping) return;
  L.stopping = true;
  stopLiveAudio(L);
  $("live-clear").disabled = true;
  $("live-stop").disabled = true;
  if (L.ws.readyState === WebSocket.OPEN) {
    // Everything sent is drawn, then `end` with the stats, then the server closes.
    L.ws.send(JSON.stringify({ type: "end" }));
    setStatus("live-status", "finishing…");
  } else {
    L.ws.close();
  }
}

// ---------------------------------------------------------------- wiring

function dropInto(fieldset, input) {
  fieldset.addEventListener("dragover", (ev) => {
    ev.preventDefault();
    fieldset.classList.add("dragging");
  });
  fieldset.addEventListener("dragleave", () => fieldset.classList.remove("dragging"));
  fieldset.addEventListener("drop", (ev) => {
    ev.preventDefault();
    fieldset.classList.remove("dragging");
    if (!ev.dataTransfer.files.length) return;
    input.files = ev.dataTransfer.files;
    input.dispatchEvent(new Event("change"));
  });
}

function main() {
  const form = $("form");
  form.noValidate = true;
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    generate();
  });
  $("face-file").addEventListener("change", () => chooseFace($("face-file").files[0]));
  $("audio-file").addEventListener("change", () => {
    const f = $("audio-file").files[0];
    chooseAudio(f || null, f ? f.name : "");
    setStatus("audio-status", f ? `${f.name}, ${(f.size / 1024).toFixed(0)} KiB` : "");
  });
  $("keep-avatar").addEventListener("click", keepAvatar);
  $("api-key").addEventListener("change", () => sessionStorage.setItem(KEY_KEY, $("api-key").value.trim()));
  dropInto($("face-drop"), $("face-file"));
  dropInto($("audio-drop"), $("audio-file"));
  setupBoxDrawing();
  if (navigator.mediaDevices && window.AudioWorkletNode) {
    $("record").hidden = false;
    $("record").addEventListener("click", () => (state.recorder ? stopRecording() : startRecording()));
  }
  if (navigator.mediaDevices && window.AudioWorkletNode && window.MediaSource && window.WebSocket) {
    $("live").hidden = false;
    $("live-start").addEventListener("click", startLive);
    $("live-clear").addEventListener("click", interruptLive);
    $("live-stop").addEventListener("click", stopLive);
    $("live-gate").addEventListener("input", () => { $("live-gate-value").textContent = `${$("live-gate").value} dBFS`; });
    $("live-sound").addEventListener("change", () => { $("live-video").muted = !$("live-sound").checked; });
  }
  renderAvatars();
  loadInfo();
  // Files the browser kept across a reload.
  if ($("face-file").files[0]) chooseFace($("face-file").files[0]);
  if ($("audio-file").files[0]) chooseAudio($("audio-file").files[0], $("audio-file").files[0].name);
}

main();
