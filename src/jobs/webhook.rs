//! Webhooks: when a batch job ends, its JSON is POSTed, signed, to the URL given at submit.
//!
//! One delivery attempt is [`deliver`]: the body is the job as [`super::job_json`] renders it
//! ([`job_body`]), sent with
//!
//! - `Content-Type: application/json`
//! - `X-Lipsync-Event`: `job.succeeded`, `job.failed` or `job.cancelled`
//! - `X-Lipsync-Delivery`: the same for every attempt of one event (`<job id>:<event>`,
//!   [`delivery_id`]): a receiver that has already handled it can answer 2xx and do nothing,
//!   since an attempt whose 2xx answer was lost (a timeout, a restart) is sent again
//! - `X-Lipsync-Attempt`: 1 for the first try, 2 for the first retry, …
//! - `X-Lipsync-Signature: sha256=<hex>`: the lowercase hex HMAC-SHA256 of the exact body
//!   bytes keyed with `--webhook-secret` ([`signature`], [`verify_signature`]); absent without
//!   a secret (the caller passes `None` for an empty `--webhook-secret`)
//!
//! An attempt succeeds on a 2xx answer; anything else (another status, a redirect, no answer
//! within the attempt's timeout) is tried again after the delays of `--webhook-retry-seconds`
//! ([`RetrySchedule`], by default 20, 40, 80, 160 and 320 s: six tries over about ten
//! minutes). Recording attempts and scheduling the next one is the job store's work.
//!
//! # Which targets are allowed
//!
//! A webhook makes the service send a request to an address someone else chose, so the
//! targets are limited ([`Allow`], `--webhook-allow`):
//!
//! - The URL must be `http` or `https`, with a host and without `user:password@`.
//! - By default any host is allowed except link-local addresses and cloud metadata services
//!   ([`BLOCKED_NETS`], [`BLOCKED_NAMES`]), which hand out credentials to whoever asks from
//!   inside the machine. Loopback and private ranges are allowed: a receiver beside the
//!   service, or on the same private network, is the common case.
//! - With `--webhook-allow` (host names, `*.domain` for its subdomains, addresses and CIDRs,
//!   comma-separated), only those are allowed: a URL whose host name is listed, or every one
//!   of whose addresses lies in a listed address or CIDR. The link-local and metadata rule
//!   still applies to listed hosts and ranges, except for an address or name the list gives
//!   exactly (`169.254.169.254`, not `169.254.0.0/16`; `metadata.google.internal`, not
//!   `*.internal`): to reach a metadata server on purpose, list both its name and address.
//!
//! A host name is resolved and every address it resolves to is checked, at submit
//! ([`check_target`], a refusal being `400 webhook_not_allowed`) and again at each attempt,
//! since DNS may have changed. The attempt then connects to the addresses it checked, not to
//! a second lookup's (no DNS rebinding), without any proxy from the environment, and never
//! follows a redirect (a 3xx answer is a failed attempt).

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use url::{Host, Url};

use super::{JobRecord, Millis};

pub const EVENT_HEADER: &str = "x-lipsync-event";
pub const DELIVERY_HEADER: &str = "x-lipsync-delivery";
pub const ATTEMPT_HEADER: &str = "x-lipsync-attempt";
pub const SIGNATURE_HEADER: &str = "x-lipsync-signature";

/// How long one attempt may take, from resolving the host to the answer's status line.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// `--webhook-retry-seconds`' default.
pub const DEFAULT_RETRY_SECONDS: &str = "20,40,80,160,320";

/// Longest accepted URL.
const MAX_URL_LEN: usize = 2048;

/// Address ranges never allowed by default: link-local (where the metadata services of AWS,
/// GCP, Azure, DigitalOcean, OpenStack, Oracle and Hetzner answer at 169.254.169.254, ECS task
/// metadata at 169.254.170.2, Tencent's at 169.254.0.23) and the metadata services elsewhere:
/// Alibaba Cloud (100.100.100.200), AWS over IPv6 (fd00:ec2::254), GCP over IPv6
/// (fd20:ce::254) and Oracle Cloud's legacy address (192.0.0.192). IPv4 addresses written as
/// IPv6 (`::ffff:a.b.c.d`, and NAT64's `64:ff9b::a.b.c.d`) are checked as IPv4.
pub const BLOCKED_NETS: &[(&str, &str)] = &[
    ("169.254.0.0/16", "link-local"),
    ("fe80::/10", "link-local"),
    ("100.100.100.200/32", "cloud metadata"),
    ("192.0.0.192/32", "cloud metadata"),
    ("fd00:ec2::254/128", "cloud metadata"),
    ("fd20:ce::254/128", "cloud metadata"),
];

/// Host names of cloud metadata services, refused whatever they resolve to (GCP's and its
/// short forms, AWS's `instance-data`, Tencent's, Equinix Metal's, which answer at public
/// addresses).
pub const BLOCKED_NAMES: &[&str] = &[
    "metadata.google.internal",
    "metadata.goog",
    "metadata",
    "instance-data",
    "instance-data.ec2.internal",
    "metadata.tencentyun.com",
    "metadata.platformequinix.com",
    "metadata.packet.net",
];

/// Why a webhook URL is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WebhookError {
    #[error("webhook_url is not a usable URL: {0}")]
    BadUrl(String),
    #[error("webhook_url's host {host} is not allowed: {reason}")]
    NotAllowed { host: String, reason: String },
    #[error("webhook_url's host {host} cannot be checked: it does not resolve ({reason})")]
    Unresolvable { host: String, reason: String },
}

impl WebhookError {
    /// The API's `error_type` (all answered with 400).
    pub fn error_type(&self) -> &'static str {
        match self {
            WebhookError::BadUrl(_) => "bad_field",
            WebhookError::NotAllowed { .. } | WebhookError::Unresolvable { .. } => {
                "webhook_not_allowed"
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Signatures

type HmacSha256 = Hmac<Sha256>;

/// HMAC-SHA256 of `body` keyed with `secret`.
pub fn hmac_sha256(secret: &[u8], body: &[u8]) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(body);
    mac.finalize().into_bytes().into()
}

/// The `X-Lipsync-Signature` value: `sha256=` + the lowercase hex HMAC-SHA256 of `body`.
pub fn signature(secret: &[u8], body: &[u8]) -> String {
    let mut s = String::with_capacity(7 + 64);
    s.push_str("sha256=");
    for b in hmac_sha256(secret, body) {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Whether `header` (an `X-Lipsync-Signature` value) signs `body` with `secret`, compared in
/// constant time: what a receiver does.
pub fn verify_signature(secret: &[u8], body: &[u8], header: &str) -> bool {
    let Some(hex) = header.trim().strip_prefix("sha256=") else {
        return false;
    };
    let Some(tag) = decode_hex(hex) else {
        return false;
    };
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(body);
    mac.verify_slice(&tag).is_ok()
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Retries

/// The delays between attempts (`--webhook-retry-seconds`): after the first failed try the
/// first delay, and so on; once they are used up the webhook is given up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetrySchedule {
    delays: Vec<Duration>,
}

impl RetrySchedule {
    /// Longest accepted delay: a week.
    pub const MAX_DELAY: Duration = Duration::from_secs(7 * 24 * 3600);
    /// Most accepted retries.
    pub const MAX_RETRIES: usize = 100;

    pub fn new(delays: Vec<Duration>) -> Self {
        RetrySchedule { delays }
    }

    pub fn delays(&self) -> &[Duration] {
        &self.delays
    }

    /// The wait before the next try when `attempts_made` tries have failed: zero before the
    /// first, then the schedule's delays; `None` when no try is left.
    pub fn next_delay(&self, attempts_made: u32) -> Option<Duration> {
        match attempts_made {
            0 => Some(Duration::ZERO),
            n => self.delays.get(n as usize - 1).copied(),
        }
    }

    /// When the next try is due, `attempts_made` having failed by `now`; `None`: give up.
    pub fn next_at(&self, now: Millis, attempts_made: u32) -> Option<Millis> {
        self.next_delay(attempts_made)
            .map(|d| now.saturating_add(d.as_millis().min(i64::MAX as u128) as i64))
    }

    /// Tries in all, the first included.
    pub fn tries(&self) -> u32 {
        self.delays.len() as u32 + 1
    }

    /// The time from the first try to the last.
    pub fn total(&self) -> Duration {
        self.delays.iter().sum()
    }
}

impl Default for RetrySchedule {
    fn default() -> Self {
        DEFAULT_RETRY_SECONDS.parse().expect("the default parses")
    }
}

impl FromStr for RetrySchedule {
    type Err = String;

    /// Seconds, comma-separated, fractions allowed (`20,40,80`, `0.2,0.5`); `none` or an empty
    /// string: no retries.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() || s.eq_ignore_ascii_case("none") {
            return Ok(RetrySchedule::new(Vec::new()));
        }
        let mut delays = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            let bad = |why: &str| {
                format!("webhook retry delays: {part:?} {why} (seconds, comma-separated, such as {DEFAULT_RETRY_SECONDS})")
            };
            let secs: f64 = part.parse().map_err(|_| bad("is not a number"))?;
            if !secs.is_finite() || secs < 0.0 {
                return Err(bad("is not a non-negative number"));
            }
            let d = Duration::try_from_secs_f64(secs).map_err(|_| bad("is too long"))?;
            if d > Self::MAX_DELAY {
                return Err(bad("is longer than a week"));
            }
            delays.push(d);
        }
        if delays.len() > Self::MAX_RETRIES {
            return Err(format!(
                "webhook retry delays: {} retries, at most {} allowed",
                delays.len(),
                Self::MAX_RETRIES
            ));
        }
        Ok(RetrySchedule::new(delays))
    }
}

impl fmt::Display for RetrySchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.delays.is_empty() {
            return f.write_str("none");
        }
        for (i, d) in self.delays.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}", d.as_secs_f64())?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Allowed targets

/// An address range: `addr/prefix` with the host bits cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Net {
    addr: IpAddr,
    prefix: u8,
}

impl Net {
    fn new(addr: IpAddr, prefix: u8) -> Option<Net> {
        let addr = match addr {
            IpAddr::V4(a) if prefix <= 32 => {
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask))
            }
            IpAddr::V6(a) if prefix <= 128 => {
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
                IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask))
            }
            _ => return None,
        };
        Some(Net { addr, prefix })
    }

    fn single(addr: IpAddr) -> Net {
        let prefix = if addr.is_ipv4() { 32 } else { 128 };
        Net { addr, prefix }
    }

    fn is_single(&self) -> bool {
        self.prefix == if self.addr.is_ipv4() { 32 } else { 128 }
    }

    fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_)) => {
                Net::new(ip, self.prefix) == Some(*self)
            }
            _ => false,
        }
    }
}

impl FromStr for Net {
    type Err = ();

    fn from_str(s: &str) -> Result<Net, ()> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => {
                if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(());
                }
                (a, Some(p.parse::<u8>().map_err(|_| ())?))
            }
            None => (s, None),
        };
        let addr = addr
            .strip_prefix('[')
            .and_then(|a| a.strip_suffix(']'))
            .unwrap_or(addr);
        let addr: IpAddr = addr.parse().map_err(|_| ())?;
        match prefix {
            Some(p) => Net::new(addr, p).ok_or(()),
            None => Ok(Net::single(addr)),
        }
    }
}

impl fmt::Display for Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_single() {
            write!(f, "{}", self.addr)
        } else {
            write!(f, "{}/{}", self.addr, self.prefix)
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// A host name, lowercase, without a trailing dot.
    Host(String),
    /// `*.domain`: any name under `domain` (not `domain` itself).
    Subdomains(String),
    Net(Net),
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::Host(h) => f.write_str(h),
            Entry::Subdomains(d) => write!(f, "*.{d}"),
            Entry::Net(n) => n.fmt(f),
        }
    }
}

/// Which webhook targets are allowed (`--webhook-allow`); see the module's documentation.
/// The default allows any host but link-local and cloud metadata addresses.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Allow {
    /// `None`: any host (but the blocked ones).
    list: Option<Vec<Entry>>,
}

impl Allow {
    /// Any host but link-local and metadata addresses: the default.
    pub fn any() -> Allow {
        Allow { list: None }
    }

    /// Whether this is the default policy rather than a list.
    pub fn is_any(&self) -> bool {
        self.list.is_none()
    }

    fn names_exactly_host(&self, host: &str) -> bool {
        self.list
            .iter()
            .flatten()
            .any(|e| matches!(e, Entry::Host(h) if h == host))
    }

    fn names_exactly_addr(&self, ip: IpAddr) -> bool {
        self.list
            .iter()
            .flatten()
            .any(|e| matches!(e, Entry::Net(n) if n.is_single() && n.addr == ip))
    }

    /// Whether a host `name` (lowercase, without trailing dot), resolving to `addrs` (or an
    /// address literal when `name` is `None`), may be sent to.
    fn check(&self, name: Option<&str>, addrs: &[IpAddr]) -> Result<(), String> {
        if let Some(name) = name {
            if BLOCKED_NAMES.contains(&name) && !self.names_exactly_host(name) {
                return Err("it is a cloud metadata service".into());
            }
        }
        for &ip in addrs {
            if let Some(what) = blocked(ip) {
                if !self.names_exactly_addr(ip) && !self.names_exactly_addr(ip.to_canonical()) {
                    return Err(match name {
                        Some(_) => format!("it resolves to a {what} address"),
                        None => format!("{ip} is a {what} address"),
                    });
                }
            }
        }
        let Some(list) = &self.list else {
            return Ok(());
        };
        if let Some(name) = name {
            let listed = list.iter().any(|e| match e {
                Entry::Host(h) => h == name,
                Entry::Subdomains(d) => name
                    .strip_suffix(d.as_str())
                    .is_some_and(|rest| rest.len() > 1 && rest.ends_with('.')),
                Entry::Net(_) => false,
            });
            if listed {
                return Ok(());
            }
        }
        let in_nets = |ip: IpAddr| {
            list.iter().any(
                |e| matches!(e, Entry::Net(n) if n.contains(ip) || n.contains(ip.to_canonical())),
            )
        };
        if !addrs.is_empty() && addrs.iter().all(|&ip| in_nets(ip)) {
            Ok(())
        } else {
            Err("it is not in --webhook-allow".into())
        }
    }
}

/// Why `ip` is refused unless named exactly: `Some("link-local")`, `Some("cloud metadata")`.
fn blocked(ip: IpAddr) -> Option<&'static str> {
    let mut candidates = vec![ip, ip.to_canonical()];
    if let IpAddr::V6(v6) = ip {
        // NAT64's well-known prefix 64:ff9b::/96 carries an IPv4 address in its last 32 bits.
        let bits = u128::from(v6);
        if bits >> 32 == 0x0064_ff9b_0000_0000_0000_0000 {
            candidates.push(IpAddr::V4(Ipv4Addr::from(bits as u32)));
        }
    }
    BLOCKED_NETS.iter().find_map(|(net, what)| {
        let net: Net = net.parse().expect("BLOCKED_NETS parse");
        candidates.iter().any(|&c| net.contains(c)).then_some(*what)
    })
}

/// A host name as an allow entry or URL gives it: lowercase ASCII letters, digits, `-`, `_`,
/// dots between labels; not all-numeric at the end (that would be an IPv4 address to a URL).
fn host_name(s: &str) -> Option<String> {
    let s = s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase();
    if s.is_empty() || s.len() > 253 {
        return None;
    }
    let labels: Vec<&str> = s.split('.').collect();
    let label_ok = |l: &&str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if !labels.iter().all(label_ok) {
        return None;
    }
    let last = labels[labels.len() - 1];
    if last.bytes().all(|b| b.is_ascii_digit()) || last.starts_with("0x") {
        return None;
    }
    Some(s)
}

impl FromStr for Allow {
    type Err = String;

    /// Comma-separated host names (`hooks.example.com`), `*.example.com` (its subdomains),
    /// addresses (`10.0.0.7`, `::1`, `[::1]`) and CIDRs (`10.0.0.0/8`, `fd00::/8`); `*`
    /// alone: any host but link-local and metadata addresses (the default).
    fn from_str(s: &str) -> Result<Allow, String> {
        let s = s.trim();
        if s == "*" {
            return Ok(Allow::any());
        }
        if s.is_empty() {
            return Err(
                "webhook allow list: empty (give hosts or CIDRs, or * for any host)".into(),
            );
        }
        let mut list = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            let bad = |why: &str| format!("webhook allow list: {part:?} {why}");
            if part.is_empty() {
                return Err(bad("is an empty entry"));
            }
            let entry = if let Ok(net) = part.parse::<Net>() {
                Entry::Net(net)
            } else if part.contains('/') || part.contains(':') || part.starts_with('[') {
                return Err(bad("is not an address or CIDR (addr/prefix)"));
            } else if let Some(domain) = part.strip_prefix("*.") {
                Entry::Subdomains(host_name(domain).ok_or_else(|| bad("is not *.domain"))?)
            } else {
                Entry::Host(host_name(part).ok_or_else(|| {
                    bad("is not a host name, address or CIDR (IDNs: use the xn-- form)")
                })?)
            };
            if !list.contains(&entry) {
                list.push(entry);
            }
        }
        Ok(Allow { list: Some(list) })
    }
}

impl fmt::Display for Allow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(list) = &self.list else {
            return f.write_str("*");
        };
        for (i, e) in list.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            e.fmt(f)?;
        }
        Ok(())
    }
}

/// A checked target: the URL, its host name (when not an address) and the addresses checked.
struct Target {
    url: Url,
    name: Option<String>,
    addrs: Vec<SocketAddr>,
}

fn parse_url(url: &str) -> Result<Url, WebhookError> {
    let bad = |why: &str| WebhookError::BadUrl(why.to_string());
    if url.len() > MAX_URL_LEN {
        return Err(bad("longer than 2048 bytes"));
    }
    let u = Url::parse(url).map_err(|e| WebhookError::BadUrl(e.to_string()))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(bad("the scheme must be http or https"));
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err(bad("user:password@ is not allowed in it"));
    }
    if u.host().is_none() {
        return Err(bad("it has no host"));
    }
    Ok(u)
}

/// Parses, resolves and checks `url` against `allow`.
async fn resolve_target(url: &str, allow: &Allow) -> Result<Target, WebhookError> {
    let url = parse_url(url)?;
    let port = url.port_or_known_default().unwrap_or(80);
    let host_str = url.host_str().unwrap_or_default().to_string();
    let not_allowed = |reason: String| WebhookError::NotAllowed {
        host: host_str.clone(),
        reason,
    };
    let (name, addrs) = match url.host() {
        Some(Host::Ipv4(a)) => (None, vec![SocketAddr::new(IpAddr::V4(a), port)]),
        Some(Host::Ipv6(a)) => (None, vec![SocketAddr::new(IpAddr::V6(a), port)]),
        Some(Host::Domain(d)) => {
            let name = host_name(d).ok_or_else(|| not_allowed("not a host name".into()))?;
            // The name rule first: a metadata name is refused without being looked up.
            if BLOCKED_NAMES.contains(&name.as_str()) && !allow.names_exactly_host(&name) {
                return Err(not_allowed("it is a cloud metadata service".into()));
            }
            let found = tokio::net::lookup_host((d, port)).await.map_err(|e| {
                WebhookError::Unresolvable {
                    host: host_str.clone(),
                    reason: e.to_string(),
                }
            })?;
            let mut seen = BTreeSet::new();
            let addrs: Vec<SocketAddr> = found.filter(|a| seen.insert(*a)).collect();
            if addrs.is_empty() {
                return Err(WebhookError::Unresolvable {
                    host: host_str,
                    reason: "no addresses".into(),
                });
            }
            (Some(name), addrs)
        }
        None => return Err(WebhookError::BadUrl("it has no host".into())),
    };
    let ips: Vec<IpAddr> = addrs.iter().map(|a| a.ip()).collect();
    allow.check(name.as_deref(), &ips).map_err(not_allowed)?;
    Ok(Target { url, name, addrs })
}

/// Checks a webhook URL at submit: `http`/`https`, a host, no user info, and the host (every
/// address a name resolves to) allowed by `allow`. Async because it resolves the name.
pub async fn check_target(url: &str, allow: &Allow) -> Result<(), WebhookError> {
    resolve_target(url, allow).await.map(|_| ())
}

// ---------------------------------------------------------------------------------------------
// Delivery

/// Sends webhooks: the per-attempt timeout and the `User-Agent`. Cheap to clone. Each attempt
/// gets its own connection, pinned to the addresses it checked.
#[derive(Debug, Clone)]
pub struct Client {
    timeout: Duration,
    user_agent: String,
}

impl Client {
    pub fn new(timeout: Duration) -> Client {
        Client {
            timeout,
            user_agent: format!("lipsync/{} (webhook)", env!("CARGO_PKG_VERSION")),
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl Default for Client {
    fn default() -> Self {
        Client::new(DEFAULT_TIMEOUT)
    }
}

/// What one attempt is about.
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    /// `job.succeeded`, `job.failed`, `job.cancelled` (`JobStatus::event`).
    pub name: &'a str,
    /// Sent as `X-Lipsync-Delivery`: the same on every attempt ([`delivery_id`]).
    pub delivery_id: &'a str,
    /// 1 for the first try.
    pub attempt: u32,
}

/// The `X-Lipsync-Delivery` of a job's event: `<job id>:<event>`, the same on every attempt.
pub fn delivery_id(job_id: &str, event: &str) -> String {
    format!("{job_id}:{event}")
}

/// The webhook's body: the job as `GET /v1/jobs/{id}` shows it.
pub fn job_body(r: &JobRecord) -> Vec<u8> {
    serde_json::to_vec(&super::job_json(r)).expect("JSON values serialise")
}

/// One attempt's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// A 2xx answer.
    pub ok: bool,
    /// The answer's status code (`"200"`, `"500"`, `"302"`), or why there was none:
    /// `"timeout"` (no answer within the client's timeout), `"connect"` (refused, unreachable,
    /// TLS handshake failed), `"dns"` (the host no longer resolves), `"not_allowed"` (the
    /// target is no longer allowed, or the URL is unusable), `"error"` (any other failure).
    pub status: String,
}

impl Delivery {
    fn failed(status: &str) -> Delivery {
        Delivery {
            ok: false,
            status: status.to_string(),
        }
    }
}

/// Makes one delivery attempt of `body` for `event` to `url`: the target is checked (and
/// resolved) again, the request sent to the addresses checked, redirects not followed; the
/// whole attempt bounded by the client's timeout. `secret` signs the body when given.
pub async fn deliver(
    client: &Client,
    url: &str,
    event: &Event<'_>,
    body: &[u8],
    secret: Option<&[u8]>,
    allow: &Allow,
) -> Delivery {
    let attempt = attempt(client, url, event, body, secret, allow);
    match tokio::time::timeout(client.timeout, attempt).await {
        Ok(d) => d,
        Err(_) => Delivery::failed("timeout"),
    }
}

async fn attempt(
    client: &Client,
    url: &str,
    event: &Event<'_>,
    body: &[u8],
    secret: Option<&[u8]>,
    allow: &Allow,
) -> Delivery {
    let target = match resolve_target(url, allow).await {
        Ok(t) => t,
        Err(WebhookError::Unresolvable { .. }) => return Delivery::failed("dns"),
        Err(e) => {
            tracing::warn!("webhook {}: {e}", event.delivery_id);
            return Delivery::failed("not_allowed");
        }
    };
    send(client, target, event, body, secret).await
}

/// Sends to a checked target, connecting only to its addresses.
async fn send(
    client: &Client,
    target: Target,
    event: &Event<'_>,
    body: &[u8],
    secret: Option<&[u8]>,
) -> Delivery {
    let mut builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(client.timeout)
        .connect_timeout(client.timeout)
        .user_agent(client.user_agent.as_str());
    if target.name.is_some() {
        // The connection goes to the addresses just checked, never to a fresh lookup's.
        if let Some(host) = target.url.host_str() {
            builder = builder.resolve_to_addrs(host, &target.addrs);
        }
    }
    let http = match builder.build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("webhook client: {e}");
            return Delivery::failed("error");
        }
    };
    let mut request = http
        .post(target.url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(EVENT_HEADER, event.name)
        .header(DELIVERY_HEADER, event.delivery_id)
        .header(ATTEMPT_HEADER, event.attempt.to_string());
    if let Some(secret) = secret {
        request = request.header(SIGNATURE_HEADER, signature(secret, body));
    }
    match request.body(body.to_vec()).send().await {
        Ok(response) => {
            let status = response.status();
            Delivery {
                ok: status.is_success(),
                status: status.as_u16().to_string(),
            }
        }
        Err(e) if e.is_timeout() => Delivery::failed("timeout"),
        Err(e) if e.is_connect() => Delivery::failed("connect"),
        Err(e) => {
            tracing::debug!("webhook {}: {e}", event.delivery_id);
            Delivery::failed("error")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// RFC 4231 section 4, test cases 1 to 7: (key, data, HMAC-SHA-256; case 5 truncated to
    /// 128 bits).
    fn rfc4231() -> Vec<(Vec<u8>, Vec<u8>, &'static str)> {
        let big_key = vec![0xaa; 131];
        vec![
            (
                vec![0x0b; 20],
                b"Hi There".to_vec(),
                "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
            ),
            (
                b"Jefe".to_vec(),
                b"what do ya want for nothing?".to_vec(),
                "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
            ),
            (
                vec![0xaa; 20],
                vec![0xdd; 50],
                "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
            ),
            (
                (1..=25).collect(),
                vec![0xcd; 50],
                "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
            ),
            (
                vec![0x0c; 20],
                b"Test With Truncation".to_vec(),
                "a3b6167473100ee06e0c796c2955552b",
            ),
            (
                big_key.clone(),
                b"Test Using Larger Than Block-Size Key - Hash Key First".to_vec(),
                "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
            ),
            (
                big_key,
                b"This is a test using a larger than block-size key and a larger than block-size data. The key needs to be hashed before being used by the HMAC algorithm.".to_vec(),
                "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
            ),
        ]
    }

    #[test]
    fn hmac_matches_rfc4231() {
        for (i, (key, data, mac)) in rfc4231().into_iter().enumerate() {
            let got = hex(&hmac_sha256(&key, &data));
            assert_eq!(&got[..mac.len()], mac, "RFC 4231 case {}", i + 1);
            if mac.len() == 64 {
                assert!(verify_signature(&key, &data, &format!("sha256={mac}")));
            }
        }
    }

    #[test]
    fn signatures_verify_and_reject() {
        let s = signature(b"key", b"{\"id\":1}");
        assert!(s.starts_with("sha256=") && s.len() == 7 + 64);
        assert_eq!(s, s.to_lowercase());
        assert!(verify_signature(b"key", b"{\"id\":1}", &s));
        assert!(!verify_signature(b"key", b"{\"id\":2}", &s));
        assert!(!verify_signature(b"other", b"{\"id\":1}", &s));
        assert!(!verify_signature(b"key", b"{\"id\":1}", &s[7..]));
        assert!(!verify_signature(b"key", b"{\"id\":1}", "sha256=zz"));
        assert_eq!(decode_hex("+a"), None);
        assert_eq!(decode_hex("0aFf"), Some(vec![0x0a, 0xff]));
        assert!(!verify_signature(b"key", b"{\"id\":1}", &s[..40]));
    }

    #[test]
    fn default_retries_are_six_tries_over_about_ten_minutes() {
        let r = RetrySchedule::default();
        assert_eq!(r.tries(), 6);
        assert_eq!(r.total(), Duration::from_secs(620));
        assert_eq!(r.next_delay(0), Some(Duration::ZERO));
        assert_eq!(r.next_delay(1), Some(Duration::from_secs(20)));
        assert_eq!(r.next_delay(5), Some(Duration::from_secs(320)));
        assert_eq!(r.next_delay(6), None);
        assert_eq!(r.next_at(1_000, 2), Some(41_000));
        assert_eq!(r.next_at(1_000, 6), None);
        assert_eq!(r.to_string(), DEFAULT_RETRY_SECONDS);
    }

    #[test]
    fn retry_schedules_parse_fractions_and_refuse_nonsense() {
        let r: RetrySchedule = " 0.2, 0.5 ".parse().unwrap();
        assert_eq!(
            r.delays(),
            &[Duration::from_millis(200), Duration::from_millis(500)]
        );
        assert_eq!(r.to_string(), "0.2,0.5");
        assert_eq!(r.tries(), 3);
        let none: RetrySchedule = "none".parse().unwrap();
        assert_eq!((none.tries(), none.next_delay(1)), (1, None));
        assert_eq!("".parse::<RetrySchedule>().unwrap(), none);
        for bad in [
            "20,,40", "-1", "abc", "nan", "inf", "1e30", "700000", "20;40",
        ] {
            let e = bad.parse::<RetrySchedule>().unwrap_err();
            assert!(e.contains("seconds") || e.contains("retries"), "{bad}: {e}");
        }
        let many = vec!["1"; 101].join(",");
        assert!(many.parse::<RetrySchedule>().is_err());
    }

    #[test]
    fn allow_lists_parse_hosts_and_cidrs() {
        let a: Allow =
            "Hooks.Example.com., *.example.org, 10.1.2.3/8, 192.168.1.7, ::1, [fd00::1], fd00:ab::/32"
                .parse()
                .unwrap();
        assert_eq!(
            a.to_string(),
            "hooks.example.com,*.example.org,10.0.0.0/8,192.168.1.7,::1,fd00::1,fd00:ab::/32"
        );
        assert_eq!(a.to_string().parse::<Allow>().unwrap(), a);
        assert_eq!("*".parse::<Allow>().unwrap(), Allow::any());
        assert_eq!(Allow::default(), Allow::any());
        assert_eq!(Allow::any().to_string(), "*");
        assert!(!a.is_any());
        for bad in [
            "",
            " , ",
            "a,,b",
            "10.0.0.0/33",
            "fd00::/129",
            "10.0.0.0/",
            "10.0.0.0/-1",
            "10.0.0.0/8/8",
            "10.0.0",
            "1.2.3.4.5",
            "example.com:8080",
            "http://example.com",
            "exa mple.com",
            "bücher.de",
            "*.",
            "a,*",
            "[::1",
            "::g",
        ] {
            assert!(bad.parse::<Allow>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn nets_contain_what_they_should() {
        let n: Net = "10.0.0.0/8".parse().unwrap();
        assert!(n.contains("10.255.1.2".parse().unwrap()));
        assert!(!n.contains("11.0.0.1".parse().unwrap()));
        assert!(!n.contains("::ffff:10.0.0.1".parse().unwrap()));
        let all: Net = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("8.8.8.8".parse().unwrap()));
        let v6: Net = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fdff::1".parse().unwrap()));
        assert!(!v6.contains("fe00::1".parse().unwrap()));
        let all6: Net = "::/0".parse().unwrap();
        assert!(all6.contains("2001:db8::1".parse().unwrap()));
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn default_policy_refuses_link_local_and_metadata_only() {
        let any = Allow::any();
        for refused in [
            "169.254.169.254",
            "169.254.170.2",
            "169.254.0.1",
            "fe80::1",
            "febf::1",
            "100.100.100.200",
            "192.0.0.192",
            "fd00:ec2::254",
            "fd20:ce::254",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
        ] {
            assert!(
                any.check(None, &[ip(refused)]).is_err(),
                "{refused} allowed"
            );
        }
        for allowed in [
            "127.0.0.1",
            "::1",
            "10.0.0.1",
            "192.168.1.1",
            "172.16.0.1",
            "8.8.8.8",
            "2001:db8::1",
            "fd00:ec2::253",
            "100.100.100.201",
        ] {
            assert!(any.check(None, &[ip(allowed)]).is_ok(), "{allowed} refused");
        }
        assert!(any.check(Some("metadata.google.internal"), &[]).is_err());
        assert!(any.check(Some("metadata"), &[ip("10.0.0.1")]).is_err());
        assert!(any
            .check(Some("hooks.example.com"), &[ip("8.8.8.8")])
            .is_ok());
        // A name with one bad address among good ones is refused.
        let e = any
            .check(
                Some("hooks.example.com"),
                &[ip("8.8.8.8"), ip("169.254.169.254")],
            )
            .unwrap_err();
        assert!(e.contains("link-local") && !e.contains("169.254"), "{e}");
    }

    #[test]
    fn lists_allow_only_what_they_name() {
        let a: Allow = "hooks.example.com,*.corp.example,10.0.0.0/8,fd00::/8"
            .parse()
            .unwrap();
        assert!(a.check(None, &[ip("10.2.3.4")]).is_ok());
        assert!(a.check(None, &[ip("fd12::1")]).is_ok());
        assert!(a.check(None, &[ip("::ffff:10.2.3.4")]).is_ok());
        assert!(a.check(None, &[ip("127.0.0.1")]).is_err());
        assert!(a.check(Some("hooks.example.com"), &[ip("8.8.8.8")]).is_ok());
        assert!(a.check(Some("a.b.corp.example"), &[ip("8.8.8.8")]).is_ok());
        assert!(a.check(Some("corp.example"), &[ip("8.8.8.8")]).is_err());
        assert!(a.check(Some("xcorp.example"), &[ip("8.8.8.8")]).is_err());
        // An unlisted name is allowed only when all its addresses are in listed ranges.
        assert!(a.check(Some("other.example"), &[ip("10.0.0.5")]).is_ok());
        assert!(a
            .check(Some("other.example"), &[ip("10.0.0.5"), ip("8.8.8.8")])
            .is_err());
        // Listed names and ranges still exclude link-local and metadata addresses...
        let wide: Allow = "0.0.0.0/0,::/0,hooks.example.com,*.internal"
            .parse()
            .unwrap();
        assert!(wide.check(None, &[ip("169.254.169.254")]).is_err());
        assert!(wide.check(None, &[ip("fe80::1")]).is_err());
        assert!(wide
            .check(Some("hooks.example.com"), &[ip("169.254.169.254")])
            .is_err());
        assert!(wide
            .check(Some("metadata.google.internal"), &[ip("8.8.8.8")])
            .is_err());
        // ...unless the list gives that exact address or name.
        let exact: Allow = "169.254.169.254,metadata.google.internal".parse().unwrap();
        assert!(exact.check(None, &[ip("169.254.169.254")]).is_ok());
        assert!(exact
            .check(Some("metadata.google.internal"), &[ip("169.254.169.254")])
            .is_ok());
        assert!(exact.check(None, &[ip("169.254.169.253")]).is_err());
        let range: Allow = "169.254.0.0/16".parse().unwrap();
        assert!(range.check(None, &[ip("169.254.169.254")]).is_err());
    }

    #[tokio::test]
    async fn a_checked_name_is_connected_to_its_checked_addresses() {
        // `pinned.invalid` resolves nowhere: the request can only reach the receiver through
        // the addresses the check found, not through a second lookup.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let receiver = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = conn.read(&mut buf).await.unwrap();
                assert!(n > 0);
                seen.extend_from_slice(&buf[..n]);
            }
            conn.write_all(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
                .await
                .unwrap();
            String::from_utf8_lossy(&seen).to_lowercase()
        });
        let target = Target {
            url: Url::parse(&format!("http://pinned.invalid:{}/hook", addr.port())).unwrap(),
            name: Some("pinned.invalid".into()),
            // The port is the URL's; the one here is ignored.
            addrs: vec![SocketAddr::new(addr.ip(), 1)],
        };
        let event = Event {
            name: "job.failed",
            delivery_id: "job_x:job.failed",
            attempt: 1,
        };
        let d = send(&Client::default(), target, &event, b"{}", None).await;
        assert_eq!(d.status, "204");
        let head = receiver.await.unwrap();
        assert!(head.starts_with("post /hook http/1.1\r\n"), "{head}");
        assert!(head.contains(&format!("\r\nhost: pinned.invalid:{}\r\n", addr.port())));
    }

    #[tokio::test]
    async fn targets_are_checked_by_url() {
        let any = Allow::any();
        for ok in [
            "http://127.0.0.1:9/hook",
            "https://127.0.0.1/hook?x=1",
            "http://[::1]:8080/",
            "http://localhost:9/",
        ] {
            check_target(ok, &any).await.unwrap();
        }
        for (url, kind) in [
            ("ftp://127.0.0.1/", "bad_field"),
            ("file:///etc/passwd", "bad_field"),
            ("http://user:pw@127.0.0.1/", "bad_field"),
            ("http://user@127.0.0.1/", "bad_field"),
            ("not a url", "bad_field"),
            (
                "http://169.254.169.254/latest/meta-data/",
                "webhook_not_allowed",
            ),
            ("http://[fe80::1]/", "webhook_not_allowed"),
            ("http://metadata.google.internal/", "webhook_not_allowed"),
            ("http://METADATA.GOOGLE.INTERNAL./", "webhook_not_allowed"),
            ("http://[::ffff:169.254.169.254]/", "webhook_not_allowed"),
            // WHATWG URL parsing reads these as 169.254.169.254.
            ("http://2852039166/", "webhook_not_allowed"),
            ("http://0xa9.0xfe.0xa9.0xfe/", "webhook_not_allowed"),
            ("http://does-not-exist.invalid/", "webhook_not_allowed"),
        ] {
            let e = check_target(url, &any).await.unwrap_err();
            assert_eq!(e.error_type(), kind, "{url}: {e}");
        }
        let list: Allow = "10.0.0.0/8".parse().unwrap();
        let e = check_target("http://127.0.0.1/", &list).await.unwrap_err();
        assert!(matches!(e, WebhookError::NotAllowed { .. }), "{e}");
        let long = format!("http://127.0.0.1/{}", "a".repeat(MAX_URL_LEN));
        assert!(matches!(
            check_target(&long, &any).await,
            Err(WebhookError::BadUrl(_))
        ));
    }
}
