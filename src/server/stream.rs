//! `GET /v1/stream`: a live session over a WebSocket. Speech arrives in binary messages, a
//! talking avatar goes back as it is drawn (see `openapi.yaml` for the messages).
//!
//! Before the upgrade: the API key (`Authorization: Bearer` or `?api_key=`), the `Origin`
//! (only `--cors-origins` or the server's own host), a real upgrade request (else 426), a
//! ready engine, and a free session slot (`--max-sessions`, else 429). After it, the first
//! text message opens the session; the session itself runs on its own OS thread
//! ([`crate::engine::session`]), and this task only moves messages between the socket and it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc;

use super::error::ApiError;
use super::live_cpu::{self, CpuMeter};
use super::{avatars, constant_time_eq, App};
use crate::engine::avatar::Picture;
use crate::engine::metrics as m;
use crate::engine::session::{
    self, Activity, AudioFormat, FairShare, Input, OutFrame, SampleFormat, Session, SessionConfig,
    SessionStats, Sink,
};
use crate::engine::{self, Avatar, Engine};
use crate::media::audio::Fps;
use crate::media::jpeg;
use crate::media::video::live;
use crate::media::yuv::Region;

/// Close codes.
const NORMAL: u16 = 1000;
const GOING_AWAY: u16 = 1001;
const POLICY: u16 = 1008;
const INTERNAL: u16 = 1011;
const TRY_LATER: u16 = 1013;
const UNKNOWN_AVATAR: u16 = 4404;

/// Messages queued between a session's thread and its socket.
const OUT_QUEUE: usize = 64;

/// JPEG quality of `jpeg` output.
const JPEG_QUALITY: u8 = 85;

/// An open session's frame rate (0 until its opening is accepted), its frames' pixels, its
/// fair share, and what its enhancer costs per face (0 without one). What each face it draws
/// weighs in generator faces ([`LiveCapacity::weight`]) is worked out whenever the sessions
/// are weighed, from the capacity measured then, so the open sessions and a new one are
/// always weighed by the same measurement.
struct Open {
    fps: f64,
    pixels: u64,
    share: Arc<FairShare>,
    enhancer_seconds: f64,
}

/// The open sessions, their frame rates and fair shares, and what their frames cost the CPU.
#[derive(Default)]
pub struct Sessions {
    open: Mutex<HashMap<u64, Open>>,
    /// The live capacity the last admission or [`Sessions::reshare`] measured (what a close
    /// shares out again).
    capacity: Mutex<Option<LiveCapacity>>,
    next: AtomicU64,
    /// CPU seconds per live frame, measured as frames go out.
    pub cpu: CpuMeter,
}

/// The frame size `/info`'s session figures assume: a 512×512 avatar.
pub const REFERENCE_PIXELS: u64 = 512 * 512;

/// Why a session's opening was refused (`over_capacity`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Refusal {
    /// The model's fair share for it would be below its `min_draw_fps`: the share.
    Model(f64),
    /// The cores cannot composite and encode its frames beside the open sessions': the
    /// frames per second of its size they have left.
    Cpu(f64),
    /// Its faces, weighed by its enhancer, do not fit in the session slots the engine
    /// sustains beside the open sessions' (weighed the same way): `(taken, slots, weight)`.
    Slots(f64, usize, f64),
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Open>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn count(&self) -> usize {
        self.lock().len()
    }

    /// Live megapixels per second the sessions whose openings were accepted take, but
    /// `except`'s.
    fn megapixels_per_second(open: &HashMap<u64, Open>, except: Option<u64>) -> f64 {
        open.iter()
            .filter(|(id, o)| Some(**id) != except && o.fps > 0.0)
            .map(|(_, o)| o.fps * o.pixels as f64 / 1e6)
            .sum()
    }

    /// Frames per second of `pixels` pixels the cores can still take beside the open
    /// sessions (but `except`).
    fn cpu_room(&self, open: &HashMap<u64, Open>, except: Option<u64>, pixels: u64) -> f64 {
        let left = self.cpu.megapixels_per_second() - Self::megapixels_per_second(open, except);
        (left / (pixels.max(1) as f64 / 1e6)).max(0.0)
    }

    /// Frame rates and face weights of the sessions whose openings were accepted, but
    /// `except`; weighed by `capacity` as `sessions` sessions share the engine (the weights
    /// depend on the batch size, which grows with the sessions).
    fn demands(
        open: &HashMap<u64, Open>,
        except: Option<u64>,
        capacity: Option<LiveCapacity>,
        sessions: usize,
    ) -> Vec<(f64, f64)> {
        open.iter()
            .filter(|(id, o)| Some(**id) != except && o.fps > 0.0)
            .map(|(_, o)| (o.fps, weigh(capacity, sessions, o.enhancer_seconds)))
            .collect()
    }

    /// How many sessions whose openings were accepted, but `except`.
    fn accepted(open: &HashMap<u64, Open>, except: Option<u64>) -> usize {
        open.iter()
            .filter(|(id, o)| Some(**id) != except && o.fps > 0.0)
            .count()
    }

    /// Shares `capacity` out again among the open sessions (max-min fair): every session's
    /// [`FairShare`] is updated, so the sessions' drawing rates follow as others open and close.
    fn rebalance(open: &HashMap<u64, Open>, capacity: Option<LiveCapacity>) {
        let Some(capacity) = capacity else { return };
        let demands = Self::demands(open, None, Some(capacity), Self::accepted(open, None));
        let level = fair_level(capacity.fps(demands.len()), &demands);
        for o in open.values().filter(|o| o.fps > 0.0) {
            o.share.set(o.fps.min(level));
        }
    }

    /// Shares the engine's live capacity as measured now out again among the open sessions
    /// (the server calls it every second). A share set when a session opened would otherwise
    /// hold until the next opening or close, at whatever the recent batches measured then
    /// (on a busy moment, a fraction of what the engine draws once it has passed). A share may
    /// so fall below the `min_draw_fps` a session was admitted with, as when others open: the
    /// minimum is an admission's, not a promise for the session's life.
    pub fn reshare(&self, app: &App, engine: &Engine) {
        let capacity = LiveCapacity::of(app, engine);
        let open = self.lock();
        *self.capacity.lock().unwrap_or_else(|p| p.into_inner()) = capacity;
        Self::rebalance(&open, capacity);
    }

    /// A slot, unless `max` sessions are open.
    fn try_open(self: &Arc<Self>, max: usize) -> Option<Slot> {
        let mut open = self.lock();
        if open.len() >= max {
            return None;
        }
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        open.insert(
            id,
            Open {
                fps: 0.0,
                pixels: 0,
                share: Arc::new(FairShare::new(0.0)),
                enhancer_seconds: 0.0,
            },
        );
        metrics::gauge!(m::STREAM_SESSIONS).set(open.len() as f64);
        Some(Slot {
            sessions: self.clone(),
            id,
        })
    }
}

/// An open session's place; freed when dropped.
struct Slot {
    sessions: Arc<Sessions>,
    id: u64,
}

impl Slot {
    /// Claims a drawing rate for a session of `fps` whose frames have `pixels` pixels: its
    /// max-min fair share of the engine's live capacity beside the open sessions (whose
    /// shares shrink to make room). Refused (nothing claimed) when the cores cannot take its
    /// frames beside the open sessions' (every frame is composited and encoded, drawn or
    /// held), when its faces, weighed, do not fit in the session slots beside the open
    /// sessions' (unless it is the only one), or when the share is below `min_draw_fps`.
    /// `enhancer_seconds`: what the session's enhancer costs per face (0 without one),
    /// which weighs its faces.
    fn claim(
        &self,
        app: &App,
        engine: &Engine,
        fps: f64,
        pixels: u64,
        min_draw_fps: f64,
        enhancer_seconds: f64,
    ) -> Result<(f64, Arc<FairShare>), Refusal> {
        let capacity = LiveCapacity::of(app, engine);
        let mut open = self.sessions.lock();
        let room = self.sessions.cpu_room(&open, Some(self.id), pixels);
        if room < fps {
            return Err(Refusal::Cpu(room));
        }
        // Every session weighed now, by one measurement, as they will share the engine.
        let sessions = Sessions::accepted(&open, Some(self.id)) + 1;
        let mut demands = Sessions::demands(&open, Some(self.id), capacity, sessions);
        let weight = weigh(capacity, sessions, enhancer_seconds);
        // The slots the engine sustains (not an operator's --max-sessions, which counts
        // sessions): an enhanced session takes as many as its faces weigh. The first session
        // always fits (its min_draw_fps decides), as at least one slot is always offered.
        if app.args.max_sessions.is_none() && !demands.is_empty() {
            let slots = session_slots(app, engine);
            let taken: f64 = demands.iter().map(|d| d.1).sum();
            if taken + weight > slots as f64 + 1e-9 {
                return Err(Refusal::Slots(taken, slots, weight));
            }
        }
        demands.push((fps, weight));
        let level = fair_level(
            capacity.map_or(f64::INFINITY, |c| c.fps(demands.len())),
            &demands,
        );
        let share = fps.min(level);
        if share < min_draw_fps {
            return Err(Refusal::Model(share));
        }
        let mine = open.get_mut(&self.id).expect("a slot's session is open");
        mine.fps = fps;
        mine.pixels = pixels;
        mine.enhancer_seconds = enhancer_seconds;
        let handle = mine.share.clone();
        *self
            .sessions
            .capacity
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = capacity;
        Sessions::rebalance(&open, capacity);
        if capacity.is_none() {
            handle.set(share);
        }
        Ok((share, handle))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.sessions.lock();
        open.remove(&self.id);
        let capacity = *self
            .sessions
            .capacity
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        Sessions::rebalance(&open, capacity);
        metrics::gauge!(m::STREAM_SESSIONS).set(open.len() as f64);
    }
}

/// The instances' batch cost as live sessions meet it, plus the stall a test build's fault
/// hook adds to every batch (`batch_delay_ms`, which tests use to slow the engine on purpose:
/// the lag and the drawing rates must see that slower engine as they would a slower machine;
/// builds without the hook have no stall). `None` before it is measured.
///
/// Where the model does not run on the CPU (cuda, echo): the warm-up's measurement scaled by
/// recent batches ([`crate::engine::pool::PoolStatus::recent_batch_cost`]). On the CPU device
/// the warm-up's: there the sessions' own compositing and encoding compete with the model for
/// the cores, so batch times measured while sessions run are not what more drawing would get
/// (an offer that rose with them made the sessions draw more faces than the cores could also
/// encode, and their frames went out late).
fn batch_cost(app: &App, engine: &Engine) -> Option<crate::engine::pool::BatchCost> {
    if app.cfg.device.gpu_like() {
        engine.status().recent_batch_cost().map(with_stall)
    } else {
        warm_batch_cost(engine)
    }
}

/// The warm-up's batch cost plus the fault hook's stall, for the sessions' lag: a session's
/// clock is set once, when it opens, and a lag that moved with the last few batches would
/// give sessions opened a moment apart different clocks for nothing.
fn warm_batch_cost(engine: &Engine) -> Option<crate::engine::pool::BatchCost> {
    engine.status().batch_cost().map(with_stall)
}

fn with_stall(mut cost: crate::engine::pool::BatchCost) -> crate::engine::pool::BatchCost {
    if let Some(stall) = crate::engine::faults::delay("batch_delay_ms") {
        cost.fixed += stall.as_secs_f64();
    }
    cost
}

/// Frames per second the instances sustain at their largest batch (from the warm-up), if
/// measured.
fn capacity_fps(app: &App, engine: &Engine) -> Option<f64> {
    let cost = batch_cost(app, engine)?;
    let n = engine.scheduler().limits().max_batch as f64;
    let t = cost.fixed + cost.per_frame * n;
    (t > 0.0).then(|| engine.status().instances as f64 * n / t)
}

/// Share of the instances' measured throughput live sessions can count on while meeting
/// their deadlines: batches do not start the moment a frame is due, and the sessions'
/// compositing and encoding run beside the model. On a CPU they share its cores with the
/// model (measured on 2 cores: one 25 fps session with its x264 encoder left the model about
/// 55 % of its warm-up throughput); on a GPU they do not.
fn live_utilisation(app: &App) -> f64 {
    if app.cfg.device.gpu_like() {
        0.7
    } else {
        0.45
    }
}

/// What the instances can draw for live sessions: their warm-up's batch cost as the sessions
/// meet it ([`batch_cost`]), how many there are, their largest batch and
/// [`live_utilisation`].
#[derive(Debug, Clone, Copy)]
struct LiveCapacity {
    cost: crate::engine::pool::BatchCost,
    instances: f64,
    /// The enhancers' own instances (`--enhancer-instances`).
    enhancer_instances: f64,
    max_batch: usize,
    utilisation: f64,
}

impl LiveCapacity {
    /// `None` before the warm-up has measured the batch cost.
    fn of(app: &App, engine: &Engine) -> Option<LiveCapacity> {
        Some(LiveCapacity {
            cost: batch_cost(app, engine)?,
            instances: engine.status().instances as f64,
            enhancer_instances: engine.enhancers().instances().max(1) as f64,
            max_batch: engine.scheduler().limits().max_batch.max(1),
            utilisation: live_utilisation(app),
        })
    }

    /// Faces per second for `sessions` live sessions at once: the instances' throughput at
    /// the batch those sessions' frames make together (one frame each), times the
    /// utilisation.
    fn fps(&self, sessions: usize) -> f64 {
        let b = sessions.clamp(1, self.max_batch) as f64;
        let t = self.cost.fixed + self.cost.per_frame * b;
        if t <= 0.0 {
            return f64::INFINITY;
        }
        self.instances * b / t * self.utilisation
    }

    /// What one face costs in generator faces when an enhancer taking `enhancer_seconds` per
    /// face also runs on it: `1 + (e / E) / (t(b) / (b · I))` at the batch `sessions` make
    /// together, with I model instances and E enhancer instances sharing the device (the
    /// enhancer's time per face over the instances that run it, against the generator's).
    fn weight(&self, sessions: usize, enhancer_seconds: f64) -> f64 {
        let b = sessions.clamp(1, self.max_batch) as f64;
        let per_face = (self.cost.fixed + self.cost.per_frame * b) / (b * self.instances);
        if enhancer_seconds <= 0.0 {
            1.0
        } else if per_face <= 0.0 {
            f64::INFINITY
        } else {
            1.0 + enhancer_seconds / self.enhancer_instances / per_face
        }
    }
}

/// What a face of a session whose enhancer costs `enhancer_seconds` weighs among `sessions`
/// sessions ([`LiveCapacity::weight`]; 1 before the capacity is measured).
fn weigh(capacity: Option<LiveCapacity>, sessions: usize, enhancer_seconds: f64) -> f64 {
    capacity.map_or(1.0, |c| c.weight(sessions, enhancer_seconds))
}

/// The max-min fair level of `capacity` (in generator faces per second) among `demands`,
/// `(faces per second, weight)`: each gets `min(demand, level)` faces per second, costing
/// `weight` generator faces each, and together they use all of it (infinite when every demand
/// fits).
fn fair_level(capacity: f64, demands: &[(f64, f64)]) -> f64 {
    let mut d: Vec<(f64, f64)> = demands.to_vec();
    d.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut left = capacity;
    let mut weights: f64 = d.iter().map(|x| x.1).sum();
    for (fps, weight) in d {
        let even = left / weights;
        if fps > even {
            return even;
        }
        left -= fps * weight;
        weights -= weight;
    }
    f64::INFINITY
}

/// `/info`'s `sessions.draw_fps`: the drawing rate one more session of a 512×512 avatar
/// would get beside the open ones (before its own frame rate caps it): the smaller of the
/// model's fair share and the frames the cores have left. `None` before the engine has
/// measured its batch cost.
pub fn next_draw_fps(app: &App, engine: &Engine) -> Option<f64> {
    next_draw_fps_with(app, engine, 0.0)
}

/// [`next_draw_fps`] for a session whose enhancer costs `enhancer_seconds` per face.
pub fn next_draw_fps_with(app: &App, engine: &Engine, enhancer_seconds: f64) -> Option<f64> {
    let capacity = LiveCapacity::of(app, engine)?;
    let open = app.sessions.lock();
    let sessions = Sessions::accepted(&open, None) + 1;
    let mut demands = Sessions::demands(&open, None, Some(capacity), sessions);
    let weight = capacity.weight(sessions, enhancer_seconds);
    demands.push((f64::INFINITY, weight));
    let level = fair_level(capacity.fps(demands.len()), &demands);
    let room = app.sessions.cpu_room(&open, None, REFERENCE_PIXELS);
    Some((level.min(room) * 10.0).round() / 10.0)
}

/// The sessions a server takes before it answers 429 at the upgrade: `--max-sessions`, or
/// the 25 fps sessions the model's measured batch times sustain (at least 1). The cores'
/// limit is checked when a session opens, with its frame size ([`Slot::claim`]).
fn session_slots(app: &App, engine: &Engine) -> usize {
    app.args.max_sessions.unwrap_or_else(|| {
        capacity_fps(app, engine).map_or(1, |fps| ((fps / 25.0).floor() as usize).max(1))
    })
}

/// `/info`'s `sessions.max_sessions`: the smaller of [`session_slots`] and the 25 fps
/// sessions of a 512×512 avatar the cores take (at least 1).
pub fn max_sessions(app: &App, engine: &Engine) -> usize {
    max_sessions_with(app, engine, 0.0)
}

/// [`max_sessions`] when every session runs an enhancer costing `enhancer_seconds` per face:
/// each then takes [`LiveCapacity::weight`] slots (with `--max-sessions`, which counts
/// sessions, the same as without).
pub fn max_sessions_with(app: &App, engine: &Engine, enhancer_seconds: f64) -> usize {
    let cpu = (app.sessions.cpu.frames_per_second(REFERENCE_PIXELS) / 25.0).floor() as usize;
    let slots = session_slots(app, engine);
    let fit = match LiveCapacity::of(app, engine) {
        Some(c) if app.args.max_sessions.is_none() && enhancer_seconds > 0.0 => {
            // The most sessions n whose weight at n sessions fits in the slots.
            (1..=slots)
                .rev()
                .find(|&n| n as f64 * c.weight(n, enhancer_seconds) <= slots as f64 + 1e-9)
                .unwrap_or(1)
        }
        _ => slots,
    };
    fit.min(cpu.max(1))
}

/// With `--api-key`: `Authorization: Bearer <key>` or `?api_key=<key>`.
fn authorize(
    app: &App,
    headers: &HeaderMap,
    query: &HashMap<String, String>,
) -> Result<(), ApiError> {
    let Some(key) = &app.args.api_key else {
        return Ok(());
    };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let given = bearer
        .or(query.get("api_key").map(String::as_str))
        .unwrap_or("");
    if constant_time_eq(given.as_bytes(), key.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong API key (send `Authorization: Bearer <key>` or `?api_key=<key>`)",
        ))
    }
}

/// An `Origin` (browsers send one) must be allowed by `--cors-origins` or be this server.
fn check_origin(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return Ok(());
    };
    let origin = origin.to_str().unwrap_or("").trim();
    let allowed = &app.args.cors_origins;
    if allowed
        .iter()
        .any(|o| o.trim() == "*" || o.trim().eq_ignore_ascii_case(origin))
    {
        return Ok(());
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let authority = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
        .unwrap_or("");
    if !host.is_empty() && authority.eq_ignore_ascii_case(host) {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        "origin_not_allowed",
        format!(
            "WebSocket connections from origin {origin:?} are not allowed (see --cors-origins)"
        ),
    ))
}

/// `GET /v1/stream`
pub async fn stream(
    State(app): State<Arc<App>>,
    query: Result<Query<HashMap<String, String>>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    let query = query.map(|q| q.0).unwrap_or_default();
    let checks = authorize(&app, &headers, &query).and_then(|_| check_origin(&app, &headers));
    if let Err(e) = checks {
        return e.into_response();
    }
    let Ok(ws) = ws else {
        return ApiError::new(
            StatusCode::UPGRADE_REQUIRED,
            "upgrade_required",
            "GET /v1/stream is a WebSocket: connect with `Connection: Upgrade`, \
             `Upgrade: websocket` (e.g. `lipsync stream` or any WebSocket client)",
        )
        .into_response();
    };
    let engine = match app.ready_engine() {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    let max = session_slots(&app, engine);
    let Some(slot) = app.sessions.try_open(max) else {
        return ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "overloaded",
            format!("{max} live sessions are open (--max-sessions)"),
        )
        .with_retry_after(5)
        .into_response();
    };
    let span = tracing::Span::current();
    ws.on_upgrade(move |socket| {
        use tracing::Instrument;
        run(socket, app, slot).instrument(span)
    })
}

/// What goes back to the client.
enum Out {
    Text(String),
    Binary(Vec<u8>),
    Close(u16, String),
}

fn error_json(error: &str, kind: &str) -> String {
    serde_json::json!({ "type": "error", "error": error, "error_type": kind }).to_string()
}

/// Sends an error message and closes with `code`.
async fn fail(socket: &mut WebSocket, code: u16, kind: &str, error: &str) {
    let _ = socket
        .send(Message::Text(error_json(error, kind).into()))
        .await;
    close(socket, code, kind).await;
}

async fn close(socket: &mut WebSocket, code: u16, reason: &str) {
    let _ = socket
        .send(Message::Close(Some(CloseFrame {
            code,
            reason: reason.chars().take(100).collect::<String>().into(),
        })))
        .await;
}

/// The client's opening message.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Opening {
    avatar_id: String,
    #[serde(default)]
    fps: Option<serde_json::Value>,
    #[serde(default)]
    audio: Option<AudioSpec>,
    #[serde(default)]
    output: Option<String>,
    #[serde(default)]
    blend: Option<String>,
    /// `pingpong` or `repeat`: how a video avatar's frames run (photo avatars ignore it).
    #[serde(default, rename = "loop")]
    loop_: Option<String>,
    /// The least drawing rate (faces/s) the client accepts; refused (`over_capacity`) below.
    #[serde(default)]
    min_draw_fps: Option<f64>,
    /// The enhancer run on every drawn face: a kind or a loaded enhancer's name (default none).
    #[serde(default)]
    enhance: Option<String>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AudioSpec {
    #[serde(default)]
    format: Option<String>,
    #[serde(default)]
    sample_rate: Option<u32>,
    #[serde(default)]
    channels: Option<u16>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    Fmp4,
    Jpeg,
}

struct Opened {
    avatar_id: String,
    fps: Fps,
    audio: AudioFormat,
    output: Output,
    blend: Option<crate::media::face::Blend>,
    loop_mode: crate::engine::Loop,
    min_draw_fps: f64,
    enhance: Option<String>,
}

/// `min_draw_fps` when the opening does not say.
pub const DEFAULT_MIN_DRAW_FPS: f64 = 5.0;

/// A bad opening: `(error_type, message)`.
fn parse_opening(text: &str) -> Result<Opened, (&'static str, String)> {
    let o: Opening = serde_json::from_str(text).map_err(|e| {
        (
            "bad_message",
            format!(
                "the first message must be {{\"avatar_id\": ..., \"fps\": 25, \"audio\": \
                 {{\"format\": \"s16le\", \"sample_rate\": 16000, \"channels\": 1}}, \
                 \"output\": \"fmp4\"}}: {e}"
            ),
        )
    })?;
    let fps = match &o.fps {
        None => Fps::DEFAULT,
        Some(serde_json::Value::Number(n)) => n
            .as_f64()
            .ok_or("not a number")
            .map_err(|e| ("bad_fps", e.to_string()))
            .and_then(|v| Fps::new(v).map_err(|e| ("bad_fps", e.to_string())))?,
        Some(serde_json::Value::String(s)) => {
            s.parse::<Fps>().map_err(|e| ("bad_fps", e.to_string()))?
        }
        Some(_) => {
            return Err((
                "bad_fps",
                "`fps` is a number or a string like \"30000/1001\"".into(),
            ))
        }
    };
    let spec = o.audio.unwrap_or(AudioSpec {
        format: None,
        sample_rate: None,
        channels: None,
    });
    let sample: SampleFormat = spec
        .format
        .as_deref()
        .unwrap_or("s16le")
        .parse()
        .map_err(|e| ("bad_audio_format", e))?;
    let audio = AudioFormat::new(
        sample,
        spec.sample_rate.unwrap_or(16_000),
        spec.channels.unwrap_or(1),
    )
    .map_err(|e| ("bad_audio_format", e))?;
    let output = match o.output.as_deref().unwrap_or("fmp4") {
        "fmp4" => Output::Fmp4,
        "jpeg" => Output::Jpeg,
        other => {
            return Err((
                "bad_output",
                format!("output {other:?}: use \"fmp4\" or \"jpeg\""),
            ))
        }
    };
    let blend = o
        .blend
        .as_deref()
        .map(|b| {
            b.parse()
                .map_err(|e: crate::media::Error| ("bad_blend", e.to_string()))
        })
        .transpose()?;
    let loop_mode = match &o.loop_ {
        Some(l) => l
            .parse::<crate::engine::Loop>()
            .map_err(|e| ("bad_loop", e.to_string()))?,
        None => crate::engine::Loop::default(),
    };
    let min_draw_fps = match o.min_draw_fps {
        None => DEFAULT_MIN_DRAW_FPS,
        Some(m) if m.is_finite() && m >= 0.0 => m,
        Some(m) => {
            return Err((
                "bad_min_draw_fps",
                format!("min_draw_fps {m}: a number of frames per second, 0 or more"),
            ))
        }
    };
    Ok(Opened {
        avatar_id: o.avatar_id,
        fps,
        audio,
        output,
        blend,
        loop_mode,
        min_draw_fps,
        enhance: o.enhance,
    })
}

/// Receives the next client message within the idle timeout: `Err` with the reason to stop.
async fn next_message(
    socket: &mut WebSocket,
    idle: Option<Duration>,
) -> Result<Option<Message>, &'static str> {
    next_message_by(socket, idle.map(|t| tokio::time::Instant::now() + t)).await
}

/// [`next_message`] with the idle deadline given.
async fn next_message_by(
    socket: &mut WebSocket,
    until: Option<tokio::time::Instant>,
) -> Result<Option<Message>, &'static str> {
    let msg = match until {
        Some(t) => match tokio::time::timeout_at(t, socket.recv()).await {
            Ok(m) => m,
            Err(_) => return Err("idle_timeout"),
        },
        None => socket.recv().await,
    };
    match msg {
        Some(Ok(m)) => Ok(Some(m)),
        _ => Ok(None), // closed or broken: the client is gone
    }
}

async fn run(mut socket: WebSocket, app: Arc<App>, slot: Slot) {
    let idle = super::config::timeout(app.args.session_idle_timeout);
    let first = loop {
        match next_message(&mut socket, idle).await {
            Err(kind) => {
                return fail(&mut socket, POLICY, kind, "no opening message in time").await
            }
            Ok(None) => return,
            Ok(Some(Message::Text(t))) => break t.to_string(),
            Ok(Some(Message::Ping(_) | Message::Pong(_))) => continue,
            Ok(Some(_)) => {
                return fail(
                    &mut socket,
                    POLICY,
                    "bad_message",
                    "the first message must be the opening JSON text message",
                )
                .await
            }
        }
    };
    let opened = match parse_opening(&first) {
        Ok(o) => o,
        Err((kind, msg)) => return fail(&mut socket, POLICY, kind, &msg).await,
    };
    let enhance = match app.enhancers.resolve(opened.enhance.as_deref()) {
        Ok(e) => e,
        Err(e) => return fail(&mut socket, POLICY, e.kind(), &e.to_string()).await,
    };
    let avatar = match avatars::lookup(&app, &opened.avatar_id).await {
        Ok(a) => a,
        Err(e) => return fail(&mut socket, UNKNOWN_AVATAR, e.kind, &e.message).await,
    };
    let avatar = match opened.blend {
        Some(b) if b != avatar.blend => Arc::new(avatar.with_blend(b)),
        _ => avatar,
    };
    let engine = match app.ready_engine() {
        Ok(e) => e,
        Err(e) => return fail(&mut socket, TRY_LATER, e.kind, &e.message).await,
    };
    let pixels = metered_pixels(&avatar, opened.output);
    let fps = opened.fps.value();
    let enhancer_seconds = enhance.as_ref().map_or(0.0, |e| e.seconds_per_face);
    let claimed = slot.claim(
        &app,
        engine,
        fps,
        pixels,
        opened.min_draw_fps,
        enhancer_seconds,
    );
    let (draw_fps, fair_share) = match claimed {
        Ok(d) => d,
        Err(refusal) => {
            let round = |x: f64| (x * 10.0).round() / 10.0;
            let (msg, could) = match refusal {
                Refusal::Model(could) => (
                    format!(
                        "beside the open sessions the engine can draw {} faces/s for this \
                         session, below its min_draw_fps {}",
                        round(could),
                        opened.min_draw_fps
                    ),
                    round(could),
                ),
                Refusal::Slots(taken, slots, weight) => (
                    format!(
                        "the engine sustains {slots} live sessions at 25 fps and the open \
                         sessions take {} of them; this session's faces, with its enhancer, \
                         weigh {} sessions",
                        round(taken),
                        round(weight)
                    ),
                    0.0,
                ),
                Refusal::Cpu(room) => (
                    format!(
                        "beside the open sessions the CPU can composite and encode {} frames/s \
                         of this avatar's size ({}x{}), below the session's {fps} fps",
                        round(room),
                        avatar.frame.width,
                        avatar.frame.height
                    ),
                    0.0,
                ),
            };
            let body = serde_json::json!({
                "type": "error", "error": msg, "error_type": "over_capacity", "draw_fps": could,
            });
            let _ = socket.send(Message::Text(body.to_string().into())).await;
            return close(&mut socket, TRY_LATER, "over_capacity").await;
        }
    };

    let (in_tx, in_rx) = std::sync::mpsc::channel::<Input>();
    let (out_tx, mut out_rx) = mpsc::channel::<Out>(OUT_QUEUE);
    let cfg = SessionConfig {
        fps: opened.fps,
        audio: opened.audio,
        utterance_gap: Duration::from_millis(app.args.utterance_gap_ms),
        lag: session_lag(&app, engine, opened.fps),
        max_undrawn_seconds: app.args.media.max_audio_seconds,
        loop_mode: opened.loop_mode,
        draw_fps: Some(draw_fps),
        fair_share: Some(fair_share),
        enhance,
    };
    let thread_app = app.clone();
    let span = tracing::Span::current();
    let spawned = std::thread::Builder::new()
        .name("lipsync-session".into())
        .spawn(move || {
            let _enter = span.enter();
            session_thread(&thread_app, avatar, cfg, opened.output, in_rx, out_tx);
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start a session thread: {e}");
        return fail(
            &mut socket,
            INTERNAL,
            "internal",
            "the server failed to start the session",
        )
        .await;
    }

    let mut ending = false;
    let mut stopping: Option<Instant> = None;
    let shutdown_timeout = Duration::from_secs(app.args.shutdown_timeout);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    // The idle timeout counts from the client's last message (frames going out don't count).
    let mut last_message = tokio::time::Instant::now();
    loop {
        let until = match (ending, idle) {
            (false, Some(t)) => Some(last_message + t),
            _ => None,
        };
        tokio::select! {
            _ = tick.tick() => {
                // SIGTERM: finish the current utterance (then close 1001), or close 1001 at
                // the shutdown timeout.
                if app.shutting_down.load(Ordering::SeqCst) {
                    let since = *stopping.get_or_insert_with(Instant::now);
                    if !ending {
                        ending = true;
                        let _ = in_tx.send(Input::End);
                    }
                    if since.elapsed() >= shutdown_timeout {
                        let msg = "the server is shutting down";
                        return fail(&mut socket, GOING_AWAY, "shutting_down", msg).await;
                    }
                }
            }
            out = out_rx.recv() => match out {
                Some(Out::Text(t)) => {
                    if socket.send(Message::Text(t.into())).await.is_err() { return; }
                }
                Some(Out::Binary(b)) => {
                    if socket.send(Message::Binary(b.into())).await.is_err() { return; }
                }
                Some(Out::Close(code, reason)) => {
                    close(&mut socket, code, &reason).await;
                    return;
                }
                None => return,
            },
            msg = next_message_by(&mut socket, until) => {
                let msg = match msg {
                    Err(kind) => {
                        let msg = format!("no message for {} s", app.args.session_idle_timeout);
                        return fail(&mut socket, POLICY, kind, &msg).await;
                    }
                    Ok(None) => return, // the client left: dropping in_tx stops the session
                    Ok(Some(m)) => m,
                };
                last_message = tokio::time::Instant::now();
                match msg {
                    Message::Binary(b) => {
                        let _ = in_tx.send(Input::Audio(b.to_vec(), Instant::now()));
                    }
                    Message::Text(t) => {
                        let kind = serde_json::from_str::<serde_json::Value>(&t)
                            .ok()
                            .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_string));
                        match kind.as_deref() {
                            Some("clear") => { let _ = in_tx.send(Input::Clear); }
                            Some("end") => { ending = true; let _ = in_tx.send(Input::End); }
                            _ => {
                                let msg = "text messages are {\"type\": \"clear\"} or {\"type\": \"end\"}";
                                return fail(&mut socket, POLICY, "bad_message", msg).await;
                            }
                        }
                    }
                    Message::Close(_) => return,
                    _ => {}
                }
            }
        }
    }
}

/// How far behind the audio the video runs: the 212.5 ms the model needs, one frame, and the
/// time a drawn face takes to come, at the warm-up's measured cost as it runs beside the live
/// sessions (divided by [`live_utilisation`]: on a CPU their compositing and encoding share its
/// cores, and a batch takes about twice its warm-up time; a lag of the bare cost leaves a drawn
/// face no time to come, so every frame would be held while the engine could draw some). That
/// time is one small batch (`--first-batch` frames) where batches have a fixed cost (a GPU);
/// on a CPU, where live frames run alone (see the scheduler), two frames: the one ahead and its
/// own. A longer lag would draw more faces but put every chunk of speech that much later.
fn session_lag(app: &App, engine: &Engine, fps: Fps) -> Duration {
    let batch = warm_batch_cost(engine).map_or(0.05, |c| {
        let frames = if c.fixed < c.per_frame {
            2.0
        } else {
            engine.scheduler().limits().first_batch as f64
        };
        c.fixed + c.per_frame * frames
    }) / live_utilisation(app);
    session::AUDIO_LOOKAHEAD + Duration::from_secs_f64(1.0 / fps.value() + batch)
}

/// The session's OS thread: the idle face, `ready`, then frames until `end` or the client
/// leaves.
fn session_thread(
    app: &App,
    avatar: Arc<Avatar>,
    cfg: SessionConfig,
    output: Output,
    inputs: std::sync::mpsc::Receiver<Input>,
    out: mpsc::Sender<Out>,
) {
    let send_error = |e: &engine::Error| {
        let (code, kind, msg) = match e {
            engine::Error::Cancelled => return,
            engine::Error::Stream(m) => (POLICY, "bad_stream", m.clone()),
            engine::Error::Media(crate::media::Error::BadLandmarks(m)) => {
                (POLICY, "bad_landmarks", m.clone())
            }
            other => {
                tracing::error!("live session failed: {other}");
                (INTERNAL, "internal", "the session failed".to_string())
            }
        };
        let _ = out.blocking_send(Out::Text(error_json(&msg, kind)));
        let _ = out.blocking_send(Out::Close(code, kind.to_string()));
    };
    let Some(engine) = app.engine.get() else {
        return send_error(&engine::Error::Inference("no engine".into()));
    };
    // A restored session's avatar needs its landmarks before its first face.
    if let Err(e) = engine::restore::prepare(&avatar, cfg.enhance.as_ref()) {
        return send_error(&e);
    }
    // A video avatar idles on its own frames: no idle face to draw.
    let face = if avatar.clip.is_some() {
        engine::scheduler::Drawn::face(Vec::new())
    } else {
        match session::idle_face(
            engine,
            &avatar,
            cfg.enhance.clone(),
            Duration::from_secs(120),
        ) {
            Ok(f) => f,
            Err(e) => return send_error(&e),
        }
    };
    let (w, h) = (avatar.frame.width, avatar.frame.height);
    let pixels = metered_pixels(&avatar, output);
    let settings = app.args.media.live_encoder(w, h, cfg.fps);
    let (mime, mut fmp4) = match output {
        Output::Jpeg => ("image/jpeg".to_string(), None),
        Output::Fmp4 => match Fmp4Sink::start(settings, out.clone()) {
            Ok(x) => x,
            Err(e) => return send_error(&e),
        },
    };
    let draw_fps = cfg
        .draw_fps
        .map(|d| (d.min(cfg.fps.value()) * 10.0).round() / 10.0);
    let ready = serde_json::json!({
        "type": "ready", "width": w, "height": h, "fps": cfg.fps.value(), "mime": mime,
        "draw_fps": draw_fps,
        // Frame k is due at this message + lag + k / fps.
        "lag_ms": (cfg.lag.as_secs_f64() * 1e4).round() / 10.0,
    });
    // The clock starts as `ready` goes out, before the client can answer it: speech that
    // came back at once is never older than the session's start (it would start the
    // utterance at frame 0, before the idle frame the session opens with).
    let start = Instant::now();
    if out.blocking_send(Out::Text(ready.to_string())).is_err() {
        return;
    }
    let session = Session::new(engine, avatar, &face, cfg, start);
    let mut jpeg = JpegSink::new(out.clone());
    let inner: &mut dyn Sink = match &mut fmp4 {
        Some(f) => f,
        None => &mut jpeg,
    };
    let sink = &mut Metered {
        inner,
        meter: &app.sessions.cpu,
        pixels,
    };
    let result = session.run(&inputs, sink).and_then(|mut stats| {
        if let Some(f) = fmp4.take() {
            stats.latencies = f.finish()?;
            stats.finish();
        }
        Ok(stats)
    });
    match result {
        Ok(stats) => {
            let end = serde_json::json!({ "type": "end", "stats": stats });
            let _ = out.blocking_send(Out::Text(end.to_string()));
            let code = if app.shutting_down.load(Ordering::SeqCst) {
                GOING_AWAY
            } else {
                NORMAL
            };
            let _ = out.blocking_send(Out::Close(code, "end".into()));
        }
        Err(e) => send_error(&e),
    }
}

/// What the CPU meter counts for each of a session's frames ([`live_cpu::metered_pixels`]). A
/// video avatar's JPEG frames cost by how its frames are stored: in segments, by rows (one
/// segment per row), or as whole JPEGs (each frame decoded and encoded whole).
fn metered_pixels(avatar: &Avatar, output: Output) -> u64 {
    use live_cpu::LiveFrame;
    let kind = match (avatar.clip.is_some(), output) {
        (false, _) => LiveFrame::Photo,
        (true, Output::Jpeg) => match avatar.stored_segments_per_row() {
            Some(1) => LiveFrame::ClipJpegRows,
            Some(_) => LiveFrame::ClipJpeg,
            None => LiveFrame::ClipJpegWhole,
        },
        (true, Output::Fmp4) => LiveFrame::Clip,
    };
    live_cpu::metered_pixels(avatar.frame.width, avatar.frame.height, kind)
}

/// `jpeg` output: per frame one binary message: u32 LE index, f64 LE pts (s), u32 LE length
/// N, N bytes of JPEG, then the frame's audio as s16le mono 16 kHz.
struct JpegSink {
    out: mpsc::Sender<Out>,
    idle_jpeg: Option<Vec<u8>>,
    /// The last speaking frame's image and its JPEG: a held frame of a photo avatar shows the
    /// same image again, and over capacity most frames are held, so it is sent again without
    /// encoding (which would take a loaded CPU's time from the frames' clock).
    last: Option<(crate::media::image::Frame, Vec<u8>)>,
}

/// A live frame as JPEG (baseline, 4:2:0, [`JPEG_QUALITY`], in restart segments: see
/// [`jpeg`]); with `base`, a JPEG of this quality in segments of a picture that equals
/// `frame` outside a region, only the segments over the region are encoded.
fn encode_jpeg(
    frame: &crate::media::image::Frame,
    base: Option<(&[u8], Region)>,
) -> Result<Vec<u8>, engine::Error> {
    if let Some((base, r)) = base {
        if let Some(segments) = jpeg::Segments::parse(base) {
            if let Some(j) = segments.with_region(frame, &r)? {
                return Ok(j);
            }
        }
    }
    let mut buf = Vec::with_capacity(frame.rgb.len() / 8);
    jpeg::encode_segmented(frame, JPEG_QUALITY, &mut buf)?;
    Ok(buf)
}

/// `{"type": "idle" | "speaking", "frame", "pts"}`
fn send_event(
    out: &mpsc::Sender<Out>,
    activity: Activity,
    frame: u64,
    pts: f64,
    so_far: &SessionStats,
) -> Result<(), engine::Error> {
    let e = serde_json::json!({
        "type": activity.as_str(), "frame": frame, "pts": pts,
        "drawn_frames": so_far.drawn_frames, "held_frames": so_far.held_frames,
    });
    out.blocking_send(Out::Text(e.to_string()))
        .map_err(|_| engine::Error::Cancelled)
}

/// `image` as JPEG, encoded unless it is `last`'s image (a held frame), and kept as `last`;
/// `base`: a JPEG in segments of a picture that equals `image` outside a region, whose other
/// segments it keeps.
fn encode_last<'l>(
    last: &'l mut Option<(crate::media::image::Frame, Vec<u8>)>,
    image: &crate::media::image::Frame,
    base: Option<(&[u8], Region)>,
) -> Result<&'l [u8], engine::Error> {
    if !last.as_ref().is_some_and(|(l, _)| l == image) {
        *last = Some((image.clone(), encode_jpeg(image, base)?));
    }
    Ok(last.as_ref().map_or(&[][..], |(_, jpeg)| jpeg))
}

impl JpegSink {
    fn new(out: mpsc::Sender<Out>) -> JpegSink {
        JpegSink {
            out,
            idle_jpeg: None,
            last: None,
        }
    }

    fn send(&self, msg: Out) -> Result<(), engine::Error> {
        self.out
            .blocking_send(msg)
            .map_err(|_| engine::Error::Cancelled)
    }
}

impl Sink for JpegSink {
    fn takes_stored_jpeg(&self) -> bool {
        true
    }

    fn event(
        &mut self,
        activity: Activity,
        frame: u64,
        pts: f64,
        so_far: &SessionStats,
    ) -> Result<(), engine::Error> {
        send_event(&self.out, activity, frame, pts, so_far)
    }

    fn frame(&mut self, f: OutFrame<'_>) -> Result<(), engine::Error> {
        let drawn;
        let jpeg: &[u8] = match f.picture {
            // A video avatar's idle frame as it is stored: neither decoded nor encoded again
            // (one generation of JPEG loss fewer, at the quality the clip was stored with).
            Picture::StoredJpeg(stored) => stored,
            // A face on a stored frame: only the segments it changed encoded, with the stored
            // frame's tables (a part the session decoded from it, so it is in segments).
            Picture::Part { part, at, stored } => {
                let spliced = match jpeg::Segments::parse(stored) {
                    Some(base) => base.with_part(part, at)?,
                    None => None,
                };
                drawn = match spliced {
                    Some(j) => j,
                    None => {
                        let whole = Picture::Part { part, at, stored }.decoded()?;
                        encode_jpeg(&whole, None)?
                    }
                };
                &drawn
            }
            Picture::Image(image) if f.idle => {
                if self.idle_jpeg.is_none() {
                    self.idle_jpeg = Some(encode_jpeg(image, None)?);
                }
                self.idle_jpeg.as_deref().unwrap_or_default()
            }
            Picture::Image(image) => {
                // A photo's frame differs from its idle frame only in `f.region`.
                let base = self.idle_jpeg.as_deref().zip(f.region);
                encode_last(&mut self.last, image, base)?
            }
        };
        let mut msg = Vec::with_capacity(16 + jpeg.len() + f.audio.len() * 2);
        msg.extend_from_slice(&(f.index as u32).to_le_bytes());
        msg.extend_from_slice(&f.pts.to_le_bytes());
        msg.extend_from_slice(&(jpeg.len() as u32).to_le_bytes());
        msg.extend_from_slice(jpeg);
        msg.extend_from_slice(&s16le(f.audio));
        self.send(Out::Binary(msg))
    }
}

/// `fmp4` output: the init segment, then one `moof`+`mdat` fragment per message, from one
/// zero-latency x264 process per session ([`live::LiveEncoder`]). Latency is measured when
/// the fragment holding a chunk's first drawn frame goes out.
struct Fmp4Sink {
    out: mpsc::Sender<Out>,
    encoder: Option<live::LiveEncoder>,
    /// `(frame, arrival)` of chunks whose first drawn frame is still in the encoder.
    waiting: Arc<Mutex<std::collections::VecDeque<(u64, Instant)>>>,
    measured: Arc<Mutex<Vec<f64>>>,
    /// The last frame, converted for the encoder: a photo avatar's next frames convert only
    /// their face region.
    converted: crate::media::yuv::Converted,
}

/// The MSE type of the encoder's output for these settings (from a one-frame encode, kept
/// per frame size and settings).
fn probe_mime(settings: &crate::media::video::EncoderSettings) -> Result<String, engine::Error> {
    static SEEN: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());
    // The profile and level depend on the preset and the bit-rate cap too.
    let key = format!(
        "{}x{}@{}:{}:{}:{:?}",
        settings.width,
        settings.height,
        settings.fps,
        settings.preset,
        settings.crf,
        settings.max_bitrate
    );
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, m)) = seen.iter().find(|(k, _)| *k == key) {
        return Ok(m.clone());
    }
    let init = Arc::new(Mutex::new(None::<String>));
    let found = init.clone();
    let mut cut = live::Fragments::default();
    let probe = live::LiveEncoder::spawn(
        settings.clone(),
        Box::new(move |data| {
            for piece in cut.push(data.unwrap_or_default()) {
                if let live::Piece::Init(b) = piece {
                    *found.lock().unwrap_or_else(|p| p.into_inner()) = Some(live::mime_type(&b));
                }
            }
        }),
    )?;
    let (w, h) = (settings.width, settings.height);
    let black = crate::media::yuv::Yuv420::black(w, h);
    let mut probe = probe;
    probe.write(&black, vec![0; 1280])?;
    probe.finish()?;
    let mime = init
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
        .ok_or_else(|| engine::Error::Inference("the encoder wrote no init segment".into()))?;
    seen.push((key, mime.clone()));
    Ok(mime)
}

impl Fmp4Sink {
    fn start(
        settings: crate::media::video::EncoderSettings,
        out: mpsc::Sender<Out>,
    ) -> Result<(String, Option<Fmp4Sink>), engine::Error> {
        let mime = probe_mime(&settings)?;
        let waiting = Arc::new(Mutex::new(
            std::collections::VecDeque::<(u64, Instant)>::new(),
        ));
        let measured = Arc::new(Mutex::new(Vec::new()));
        let (w2, m2) = (waiting.clone(), measured.clone());
        let events = out.clone();
        let mut cut = live::Fragments::default();
        let mut frames_out = 0u64;
        let mut gone = false;
        let encoder = live::LiveEncoder::spawn(
            settings,
            Box::new(move |data| {
                let Some(data) = data else { return };
                for piece in cut.push(data) {
                    let (bytes, n) = match piece {
                        live::Piece::Init(b) => (b, 0),
                        live::Piece::Fragment(b, n) => (b, n),
                    };
                    if !gone && out.blocking_send(Out::Binary(bytes)).is_err() {
                        gone = true; // keep draining ffmpeg; the session sees the client leave
                    }
                    frames_out += u64::from(n);
                    let now = Instant::now();
                    let mut w = w2.lock().unwrap_or_else(|p| p.into_inner());
                    while w.front().is_some_and(|(k, _)| *k < frames_out) {
                        let (_, at) = w.pop_front().expect("checked");
                        let l = now.saturating_duration_since(at).as_secs_f64();
                        metrics::histogram!(m::STREAM_LATENCY).record(l);
                        m2.lock().unwrap_or_else(|p| p.into_inner()).push(l);
                    }
                }
            }),
        )?;
        Ok((
            mime,
            Some(Fmp4Sink {
                out: events,
                encoder: Some(encoder),
                waiting,
                measured,
                converted: Default::default(),
            }),
        ))
    }

    /// Encodes the rest; returns every latency measured.
    fn finish(mut self) -> Result<Vec<f64>, engine::Error> {
        if let Some(e) = self.encoder.take() {
            e.finish()?;
        }
        let measured = self
            .measured
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Ok(measured)
    }
}

impl Sink for Fmp4Sink {
    fn event(
        &mut self,
        activity: Activity,
        frame: u64,
        pts: f64,
        so_far: &SessionStats,
    ) -> Result<(), engine::Error> {
        send_event(&self.out, activity, frame, pts, so_far)
    }

    fn frame(&mut self, f: OutFrame<'_>) -> Result<(), engine::Error> {
        let enc = self
            .encoder
            .as_mut()
            .ok_or_else(|| engine::Error::Inference("the encoder is closed".into()))?;
        let image = f.picture.decoded()?;
        // The region is where this frame differs from the last (see `Converted::update`), so
        // it is also all the encoder's buffer needs copied.
        let frame = self.converted.update(&image, f.region);
        Ok(enc.write_changed(frame, f.region, s16le(f.audio))?)
    }

    fn audio_lead(&self) -> Duration {
        live::AUDIO_LEAD
    }

    fn audio(&mut self, audio: &[f32]) -> Result<(), engine::Error> {
        let enc = self
            .encoder
            .as_mut()
            .ok_or_else(|| engine::Error::Inference("the encoder is closed".into()))?;
        Ok(enc.write_audio(s16le(audio))?)
    }

    fn drawn(&mut self, frame: u64, arrived: Instant) -> Option<f64> {
        self.waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back((frame, arrived));
        None
    }
}

/// 16 kHz samples as the live encoder takes them.
fn s16le(audio: &[f32]) -> Vec<u8> {
    audio
        .iter()
        .flat_map(|s| ((s.clamp(-1.0, 1.0) * 32_767.0).round() as i16).to_le_bytes())
        .collect()
}

/// Waits (at most `limit`, plus a second for the last close frames) until every live session
/// has closed: they are upgraded connections, which the HTTP server's graceful shutdown no
/// longer tracks.
pub async fn wait_closed(sessions: &Sessions, limit: Duration) {
    let until = Instant::now() + limit + Duration::from_secs(1);
    while sessions.count() > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A session's output that tells the CPU meter about every frame that goes out.
struct Metered<'a> {
    inner: &'a mut dyn Sink,
    meter: &'a CpuMeter,
    pixels: u64,
}

impl Sink for Metered<'_> {
    fn event(
        &mut self,
        activity: Activity,
        frame: u64,
        pts: f64,
        so_far: &SessionStats,
    ) -> Result<(), engine::Error> {
        self.inner.event(activity, frame, pts, so_far)
    }

    fn frame(&mut self, frame: OutFrame<'_>) -> Result<(), engine::Error> {
        self.meter.frame_sent(self.pixels);
        self.inner.frame(frame)
    }

    fn takes_stored_jpeg(&self) -> bool {
        self.inner.takes_stored_jpeg()
    }

    fn audio_lead(&self) -> Duration {
        self.inner.audio_lead()
    }

    fn audio(&mut self, audio: &[f32]) -> Result<(), engine::Error> {
        self.inner.audio(audio)
    }

    fn flush(&mut self) -> Result<(), engine::Error> {
        self.inner.flush()
    }

    fn drawn(&mut self, frame: u64, arrived: Instant) -> Option<f64> {
        self.inner.drawn(frame, arrived)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::media::image::Frame;

    #[test]
    fn fair_levels_weigh_each_sessions_faces_by_their_cost() {
        // Unweighted: 100 faces/s among 25, 25, 100 → 25, 25 and the rest (50).
        assert_eq!(
            fair_level(100.0, &[(25.0, 1.0), (25.0, 1.0), (100.0, 1.0)]),
            50.0
        );
        // Everything fits: no level.
        assert!(fair_level(100.0, &[(25.0, 1.0), (25.0, 1.0)]).is_infinite());
        // A session whose faces cost 4 each (an enhancer): at level L the two use L + 4L = 100.
        assert_eq!(fair_level(100.0, &[(25.0, 1.0), (25.0, 4.0)]), 20.0);
        // A small demand is served whole, its cost taken first: 10·3 = 30, then 70 / 1.
        assert_eq!(fair_level(100.0, &[(10.0, 3.0), (100.0, 1.0)]), 70.0);
        // The weight of a face: the enhancer's seconds over the generator's per face.
        let c = LiveCapacity {
            cost: crate::engine::pool::BatchCost {
                fixed: 0.0,
                per_frame: 0.01,
            },
            instances: 1.0,
            enhancer_instances: 1.0,
            max_batch: 16,
            utilisation: 1.0,
        };
        assert_eq!(c.weight(4, 0.0), 1.0);
        assert!((c.weight(4, 0.03) - 4.0).abs() < 1e-9);
        // Three model instances draw a face in a third of the time; one enhancer instance
        // then weighs three times as much, three of them as much as before.
        let three = LiveCapacity {
            instances: 3.0,
            ..c
        };
        assert!((three.weight(4, 0.03) - 10.0).abs() < 1e-9);
        let both = LiveCapacity {
            enhancer_instances: 3.0,
            ..three
        };
        assert!((both.weight(4, 0.03) - 4.0).abs() < 1e-9);
    }

    #[test]
    fn open_sessions_are_weighed_by_the_capacity_measured_now() {
        // An enhanced session admitted while the generator's faces cost 0.01 s weighs 4; when
        // they are measured at 0.005 s later, it weighs 7 beside the new session, as the new
        // session's own weight and the slots are worked out from that same measurement (a
        // weight kept from the admission made a session fit that did not).
        let open: HashMap<u64, Open> = [
            (1, 0.03),
            (2, 0.0),
            // Not accepted yet (fps 0): not a demand.
            (3, 0.5),
        ]
        .into_iter()
        .map(|(id, enhancer_seconds)| {
            let fps = if id == 3 { 0.0 } else { 25.0 };
            let share = Arc::new(FairShare::new(0.0));
            (
                id,
                Open {
                    fps,
                    pixels: 1,
                    share,
                    enhancer_seconds,
                },
            )
        })
        .collect();
        let at = |per_frame: f64| LiveCapacity {
            cost: crate::engine::pool::BatchCost {
                fixed: 0.0,
                per_frame,
            },
            instances: 1.0,
            enhancer_instances: 1.0,
            max_batch: 16,
            utilisation: 1.0,
        };
        assert_eq!(Sessions::accepted(&open, None), 2);
        assert_eq!(Sessions::accepted(&open, Some(2)), 1);
        let weights = |capacity: Option<LiveCapacity>| {
            let mut w: Vec<f64> = Sessions::demands(&open, None, capacity, 3)
                .into_iter()
                .map(|d| d.1)
                .collect();
            w.sort_by(f64::total_cmp);
            w
        };
        assert_eq!(weights(Some(at(0.01))), vec![1.0, 4.0]);
        assert_eq!(weights(Some(at(0.005))), vec![1.0, 7.0]);
        // Before anything is measured every face weighs 1.
        assert_eq!(weights(None), vec![1.0, 1.0]);
    }

    /// The JPEG of each binary message `sink` sent.
    fn sent_jpegs(rx: &mut mpsc::Receiver<Out>) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while let Ok(msg) = rx.try_recv() {
            if let Out::Binary(b) = msg {
                let n = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
                out.push(b[16..16 + n].to_vec());
            }
        }
        out
    }

    #[test]
    fn jpeg_frames_are_encoded_once_per_distinct_image_and_each_shows_its_own() {
        let (tx, mut rx) = mpsc::channel(16);
        let mut sink = JpegSink::new(tx);
        let image = |v: u8| Frame::new(16, 8, vec![v; 16 * 8 * 3]);
        let (a, b, idle) = (image(40), image(200), image(120));
        let audio = [0.0f32; 640];
        // A drawn face, held twice, the idle face between, held again, then a new face.
        let order = [
            (&a, false),
            (&a, false),
            (&idle, true),
            (&a, false),
            (&b, false),
        ];
        for (index, (img, is_idle)) in order.iter().enumerate() {
            sink.frame(OutFrame {
                index: index as u64,
                pts: index as f64 / 25.0,
                picture: Picture::Image(img),
                region: None,
                audio: &audio,
                idle: *is_idle,
            })
            .unwrap();
        }
        let got = sent_jpegs(&mut rx);
        assert_eq!(got.len(), order.len());
        for (jpeg, (img, _)) in got.iter().zip(order) {
            assert_eq!(jpeg, &encode_jpeg(img, None).unwrap());
        }
        assert_ne!(got[3], got[4], "a new image is encoded anew");
    }

    #[test]
    fn a_stored_frame_goes_out_as_it_is_stored() {
        let (tx, mut rx) = mpsc::channel(16);
        let mut sink = JpegSink::new(tx);
        let image = |v: u8| Frame::new(16, 8, vec![v; 16 * 8 * 3]);
        // Stored at another quality than the sink's, as a clip's frames are.
        let stored = |v: u8| {
            let mut j = Vec::new();
            crate::media::image::encode_jpeg(&image(v), 95, &mut j).unwrap();
            j
        };
        let (s1, s2, face) = (stored(30), stored(90), image(200));
        let audio = [0.0f32; 640];
        let pictures = [
            Picture::StoredJpeg(&s1),
            Picture::Image(&face),
            Picture::StoredJpeg(&s2),
            Picture::StoredJpeg(&s1),
        ];
        for (index, picture) in pictures.iter().enumerate() {
            sink.frame(OutFrame {
                index: index as u64,
                pts: index as f64 / 25.0,
                picture: picture.clone(),
                region: None,
                audio: &audio,
                idle: false,
            })
            .unwrap();
        }
        let got = sent_jpegs(&mut rx);
        assert_eq!(
            got,
            vec![s1.clone(), encode_jpeg(&face, None).unwrap(), s2, s1]
        );
    }

    /// A 192×48 picture with a gradient, and the same brighter in `region`.
    fn pictures(region: Region) -> (Frame, Frame) {
        let base = Frame::new(
            192,
            48,
            (0..192 * 48 * 3).map(|i| (i % 251) as u8).collect(),
        );
        let mut changed = base.clone();
        for y in region.y..region.y + region.height {
            let at = (y * 192 + region.x) as usize * 3;
            for v in &mut changed.rgb[at..at + region.width as usize * 3] {
                *v = v.saturating_add(60);
            }
        }
        (base, changed)
    }

    #[test]
    fn only_the_segments_a_face_changed_are_encoded_and_the_jpeg_is_the_whole_frames() {
        let (tx, mut rx) = mpsc::channel(16);
        let mut sink = JpegSink::new(tx);
        let audio = [0.0f32; 640];
        let send = |sink: &mut JpegSink, picture: Picture<'_>, region, idle| {
            sink.frame(OutFrame {
                index: 0,
                pts: 0.0,
                picture,
                region,
                audio: &audio,
                idle,
            })
            .unwrap();
        };
        let at = |x, y, width, height| Region {
            x,
            y,
            width,
            height,
        };
        // A photo: the idle frame, then one that differs in its face region.
        let region = at(70, 20, 40, 10);
        let (idle, speaking) = pictures(region);
        send(&mut sink, Picture::Image(&idle), Some(region), true);
        send(&mut sink, Picture::Image(&speaking), Some(region), false);
        // A clip's stored frame (quality 95) with a face drawn in 80..112 × 33..48: the
        // session decoded the segments over it (pixels 64..128 × 32..48) and drew on them.
        let (frame, _) = pictures(at(0, 0, 0, 0));
        let mut stored = Vec::new();
        jpeg::encode_segmented(&frame, 95, &mut stored).unwrap();
        let segments = jpeg::Segments::parse(&stored).unwrap();
        let face = at(80, 33, 32, 15);
        let (mut part, origin) = segments.decode_region(&face).unwrap();
        assert_eq!((origin, part.width, part.height), ((64, 32), 64, 16));
        for v in &mut part.rgb[64 * 3..] {
            *v = v.saturating_add(60);
        }
        let picture = Picture::Part {
            part: &part,
            at: origin,
            stored: &stored,
        };
        let drawn = picture.clone().decoded().unwrap().into_owned();
        send(&mut sink, picture, None, false);
        let got = sent_jpegs(&mut rx);
        // The stored frame's segments but for the face's, which are `drawn`'s (and the whole
        // frame's encoding where the picture is the JPEG's own: see media::jpeg's tests).
        let on_stored = segments.with_region(&drawn, &face).unwrap().unwrap();
        let want = [
            encode_jpeg(&idle, None).unwrap(),
            encode_jpeg(&speaking, None).unwrap(),
            on_stored,
        ];
        assert_eq!(got.len(), 3);
        for (k, (got, want)) in got.iter().zip(&want).enumerate() {
            assert!(got == want, "JPEG {k} differs");
        }
        // `drawn` is the stored frame decoded, with the part's pixels in their place.
        let whole = Picture::StoredJpeg(&stored).decoded().unwrap().into_owned();
        for y in 0..48usize {
            for x in 0..192usize {
                let i = (y * 192 + x) * 3;
                let inside = (64..128).contains(&x) && (32..48).contains(&y);
                let want = if inside {
                    &part.rgb[((y - 32) * 64 + x - 64) * 3..][..3]
                } else {
                    &whole.rgb[i..i + 3]
                };
                assert_eq!(&drawn.rgb[i..i + 3], want, "pixel {x}, {y}");
            }
        }
        // The segments were spliced, not the frames encoded whole: a base whose segments
        // outside the region differ from the frame's shows through.
        let (other, _) = pictures(at(0, 0, 0, 0));
        let mut shifted = other.clone();
        shifted.rgb.rotate_left(3);
        let base = encode_jpeg(&shifted, None).unwrap();
        let spliced = encode_jpeg(&speaking, Some((&base, region))).unwrap();
        assert_ne!(spliced, encode_jpeg(&speaking, None).unwrap());
    }
}
