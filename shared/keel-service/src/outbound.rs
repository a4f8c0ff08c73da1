//! Outbound HTTP to addresses that a request or a run spec names (an `http` or `agent`
//! environment's URL, an MLflow tracking server). Without a limit anyone who can submit a
//! run could make a service reach the machines only it can reach (the cloud metadata
//! endpoint, a database, another service's internal API), so:
//!
//! - only ordinary public unicast addresses may be called ([`is_public`]: loopback, private,
//!   link-local, shared, documentation, benchmarking, reserved, multicast and every other
//!   IANA special-purpose range, NAT64, 6to4, Teredo and IPv4-compatible IPv6 included are
//!   not), unless the operator allows them: all of them, or those of named hosts only
//!   ([`PrivateAccess`]). Literal addresses are checked when the URL is taken; names when
//!   they resolve ([`PublicOnly`]), so a name that points inside is refused too;
//! - a redirect is followed only to the same host and port (or from `http` to `https` on the
//!   same host), at most [`MAX_REDIRECTS`] times: a public server cannot send the request,
//!   its body and its headers somewhere the first request could not go;
//! - proxy variables (`HTTP_PROXY`, ...) are ignored unless the operator enables them: a
//!   proxy resolves names itself, past the filter;
//! - every call has a connect timeout and an overall one.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use keel_protocol::FieldError;

/// The most redirects an outbound call follows.
pub const MAX_REDIRECTS: usize = 5;

/// How long an outbound call may take to connect.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Which non-public addresses a service may call: every one (`all`), or those that the named
/// `hosts` (names or literal addresses, matched without case) are or resolve to. `allowed_by`
/// says, in a refusal, which settings would allow an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrivateAccess {
    pub all: bool,
    pub hosts: Vec<String>,
    pub allowed_by: &'static str,
}

impl Default for PrivateAccess {
    /// Nothing private allowed; the settings are the reward service's.
    fn default() -> Self {
        Self {
            all: false,
            hosts: Vec::new(),
            allowed_by: "http_allow_private_addresses, or this host's with http_private_hosts",
        }
    }
}

/// A host as `hosts` are compared: without IPv6 brackets or a trailing dot, in lower case.
fn normal(host: &str) -> String {
    host.trim_start_matches('[').trim_end_matches(']').trim_end_matches('.').to_ascii_lowercase()
}

impl PrivateAccess {
    /// Every address allowed (an operator's own server).
    pub fn everything() -> Self {
        Self { all: true, ..Self::default() }
    }

    /// The resolver a client calling these URLs needs: none when every address is allowed,
    /// else [`PublicOnly`] (which lets the named hosts through).
    pub fn resolver(&self) -> Option<PublicOnly> {
        (!self.all).then(|| PublicOnly { hosts: self.hosts.iter().map(|h| normal(h)).collect() })
    }

    /// Refuses a URL host that is a non-public literal address or a `localhost` name, unless
    /// this allows it.
    pub fn check(&self, url: &reqwest::Url) -> Result<(), FieldError> {
        let host = normal(url.host_str().unwrap_or_default());
        if self.all || self.hosts.iter().any(|allowed| normal(allowed) == host) {
            return Ok(());
        }
        if refused_host(url) {
            let host = url.host_str().unwrap_or_default();
            return Err(FieldError::new(
                "url",
                format!(
                    "{host} is a loopback, private or special-purpose address; the service's operator allows \
                     those with {}",
                    self.allowed_by
                ),
            ));
        }
        Ok(())
    }

    /// An HTTP client for these URLs: names resolved by [`PublicOnly`], redirects only within
    /// the first request's origin, proxies only when `use_proxy` (the operator's setting),
    /// [`CONNECT_TIMEOUT`] and `timeout` per call.
    pub fn client(&self, use_proxy: bool, timeout: Duration) -> reqwest::Result<reqwest::Client> {
        let mut http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::custom(same_origin));
        if !use_proxy {
            http = http.no_proxy();
        }
        if let Some(resolver) = self.resolver() {
            http = http.dns_resolver(Arc::new(resolver));
        }
        http.build()
    }
}

/// The redirect policy: on to the same host and port (or from `http` to `https` on the same
/// host), at most [`MAX_REDIRECTS`] times; anything else stops with an error naming it.
fn same_origin(attempt: reqwest::redirect::Attempt) -> reqwest::redirect::Action {
    let first = &attempt.previous()[0];
    let next = attempt.url();
    let same_host = first.host_str().map(normal) == next.host_str().map(normal);
    let same_port = first.port_or_known_default() == next.port_or_known_default();
    let upgrade = first.scheme() == "http" && next.scheme() == "https" && next.port_or_known_default() == Some(443);
    if attempt.previous().len() > MAX_REDIRECTS {
        let message = format!("more than {MAX_REDIRECTS} redirects from {first}");
        attempt.error(message)
    } else if same_host && (same_port || upgrade) {
        attempt.follow()
    } else {
        let message = format!("{first} redirects to {next}, another host or port, which is not followed");
        attempt.error(message)
    }
}

/// Whether `ip` is an ordinary public unicast address: outside every IANA special-purpose
/// range (RFC 6890 and its updates), IPv4 inside IPv6 judged by the IPv4 address it maps.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_public_v4(v4),
            None => is_public_v6(v6),
        },
    }
}

fn is_public_v4(v4: Ipv4Addr) -> bool {
    let [a, b, c, _] = v4.octets();
    let special = a == 0 // "this network"
        || a == 10
        || (a == 100 && (64..128).contains(&b)) // shared address space (carrier-grade NAT)
        || a == 127
        || (a == 169 && b == 254)
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 192 && b == 0 && c == 2) // documentation
        || (a == 192 && b == 88 && c == 99) // 6to4 relay anycast
        || (a == 192 && b == 168)
        || (a == 198 && (18..20).contains(&b)) // benchmarking
        || (a == 198 && b == 51 && c == 100) // documentation
        || (a == 203 && b == 0 && c == 113) // documentation
        || a >= 224; // multicast, reserved (240/4) and broadcast
    !special
}

/// Public IPv6 is global unicast (2000::/3) outside its special-purpose blocks; everything
/// else (loopback, ULA, link- and site-local, multicast, NAT64 64:ff9b::/96 and /48,
/// IPv4-compatible ::/96, discard) is not.
fn is_public_v6(v6: Ipv6Addr) -> bool {
    let s = v6.segments();
    let global_unicast = (s[0] & 0xe000) == 0x2000;
    // 2001::/23: IETF protocol assignments (Teredo, benchmarking, ORCHID); 2001:db8::/32:
    // documentation.
    let special = (s[0] == 0x2001 && (s[1] < 0x0200 || s[1] == 0x0db8))
        || s[0] == 0x2002 // 6to4
        || (s[0] & 0xfff0) == 0x3ff0; // documentation 3fff::/20
    global_unicast && !special
}

/// Whether a URL's host is a non-public literal address, a `localhost` name or missing.
fn refused_host(url: &reqwest::Url) -> bool {
    let host = url.host_str().unwrap_or_default();
    match host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        Ok(ip) => !is_public(ip),
        Err(_) => {
            let name = host.trim_end_matches('.').to_ascii_lowercase();
            name.is_empty() || name == "localhost" || name.ends_with(".localhost")
        }
    }
}

/// A resolver that keeps only public addresses and fails when a name has none; the names in
/// `hosts` (lower case) resolve as they are.
#[derive(Debug, Clone, Default)]
pub struct PublicOnly {
    hosts: Arc<[String]>,
}

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = normal(name.as_str());
        let named = self.hosts.contains(&host);
        Box::pin(async move {
            let resolved: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if named {
                return Ok(Box::new(resolved.into_iter()) as reqwest::dns::Addrs);
            }
            let public: Vec<SocketAddr> = resolved.into_iter().filter(|a| is_public(a.ip())).collect();
            if public.is_empty() {
                let message = format!(
                    "{host} resolves only to loopback, private or special-purpose addresses, which are refused"
                );
                return Err(message.into());
            }
            Ok(Box::new(public.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use reqwest::dns::Resolve;

    use super::*;

    #[test]
    fn only_public_unicast_addresses_are_public() {
        for special in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "192.0.0.8",
            "192.0.2.1",
            "192.88.99.1",
            "198.18.0.1",
            "198.19.255.254",
            "198.51.100.7",
            "203.0.113.9",
            "224.0.0.1",
            "240.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "fec0::1",
            "ff02::1",
            "::ffff:10.0.0.1",
            "::ffff:127.0.0.1",
            "::127.0.0.1",
            "::8.8.8.8",
            "64:ff9b::a00:1",
            "64:ff9b::808:808",
            "64:ff9b:1::1",
            "100::1",
            "2001::1",
            "2001:2::1",
            "2001:db8::1",
            "2002:7f00:1::1",
            "3fff::1",
            "5f00::1",
        ] {
            assert!(!is_public(special.parse().unwrap()), "{special}");
        }
        for public in ["8.8.8.8", "1.1.1.1", "198.20.0.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "2a00:1450::1"] {
            assert!(is_public(public.parse().unwrap()), "{public}");
        }
    }

    #[test]
    fn private_literals_and_localhost_names_are_refused() {
        let access = PrivateAccess::default();
        for url in [
            "http://127.0.0.1:9/",
            "http://[::1]/x",
            "http://169.254.169.254/latest/meta-data",
            "http://localhost/",
            "http://api.localhost./",
            "http://[64:ff9b::7f00:1]/",
            "http://198.18.0.1/",
        ] {
            let error = access.check(&reqwest::Url::parse(url).unwrap()).unwrap_err().to_string();
            assert!(error.contains("http_allow_private_addresses"), "{url}: {error}");
        }
        assert!(access.check(&reqwest::Url::parse("https://rewards.example.com/score").unwrap()).is_ok());
    }

    #[tokio::test]
    async fn names_that_resolve_inside_are_refused() {
        let name = reqwest::dns::Name::from_str("localhost").unwrap();
        let error = PublicOnly::default().resolve(name).await.err().unwrap().to_string();
        assert!(error.contains("resolves only to loopback"), "{error}");
    }

    /// A named host's private addresses are allowed, by its name or literal address, in any
    /// case; other hosts' are refused as before.
    #[tokio::test]
    async fn named_hosts_may_be_private() {
        let access = PrivateAccess {
            hosts: vec!["Agent".into(), "localhost.".into(), "10.0.0.7".into()],
            ..PrivateAccess::default()
        };
        for url in ["http://agent:8091/", "http://AGENT./x", "http://localhost:9/", "http://10.0.0.7/"] {
            assert!(access.check(&reqwest::Url::parse(url).unwrap()).is_ok(), "{url}");
        }
        for url in ["http://127.0.0.1:9/", "http://10.0.0.8/", "http://api.localhost/"] {
            let error = access.check(&reqwest::Url::parse(url).unwrap()).unwrap_err().to_string();
            assert!(error.contains("http_private_hosts"), "{url}: {error}");
        }
        let all = PrivateAccess::everything();
        assert!(all.check(&reqwest::Url::parse("http://127.0.0.1/").unwrap()).is_ok());
        assert!(all.resolver().is_none());
        let resolver = access.resolver().unwrap();
        let found: Vec<SocketAddr> =
            resolver.resolve(reqwest::dns::Name::from_str("LocalHost").unwrap()).await.unwrap().collect();
        assert!(found.iter().all(|a| a.ip().is_loopback()) && !found.is_empty(), "{found:?}");
    }

    /// A server that answers every request with `status` and `Location: location`, and counts
    /// the requests it gets.
    async fn redirector(status: u16, location: String) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = hits.clone();
        let app = axum::Router::new().fallback(move || {
            let counted = counted.clone();
            let location = location.clone();
            async move {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let status = axum::http::StatusCode::from_u16(status).unwrap();
                (status, [(axum::http::header::LOCATION, location)], "moved")
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (address, hits)
    }

    /// A redirect to another port of the same machine (the attack: a plugin answering 307 to
    /// a loopback service) is not followed, body and all; one to the same origin is, up to
    /// the limit.
    #[tokio::test]
    async fn redirects_leave_neither_the_host_nor_the_port() {
        let (inside, inside_hits) = redirector(200, String::new()).await;
        let (plugin, _) = redirector(307, format!("http://{inside}/steal")).await;
        let client = PrivateAccess { hosts: vec!["127.0.0.1".into()], ..PrivateAccess::default() }
            .client(false, Duration::from_secs(5))
            .unwrap();
        let error = client.post(format!("http://{plugin}/score")).body("{}").send().await.unwrap_err();
        assert!(error.is_redirect(), "{error}");
        let message = format!("{error:?}");
        assert!(message.contains("another host or port"), "{message}");
        assert_eq!(inside_hits.load(std::sync::atomic::Ordering::SeqCst), 0, "the redirect reached the other port");

        let (looping, looping_hits) = redirector(307, "/again".into()).await;
        let error = client.post(format!("http://{looping}/score")).send().await.unwrap_err();
        assert!(format!("{error:?}").contains("more than 5 redirects"), "{error:?}");
        assert_eq!(looping_hits.load(std::sync::atomic::Ordering::SeqCst), MAX_REDIRECTS + 1);
    }

    /// With `HTTP_PROXY` naming a server (this test binary run again with it set, since a
    /// test may not change its own environment), a client calls directly unless told to use
    /// the proxy.
    #[test]
    fn proxy_variables_are_ignored_unless_enabled() {
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "outbound::tests::proxy_child", "--ignored", "--nocapture"])
            .env("HTTP_PROXY", "http://192.0.2.1:9")
            .env("http_proxy", "http://192.0.2.1:9")
            .env_remove("NO_PROXY")
            .env_remove("no_proxy")
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&child.stdout);
        assert!(child.status.success() && out.contains("1 passed"), "{out}{}", String::from_utf8_lossy(&child.stderr));
    }

    #[tokio::test]
    #[ignore = "run by proxy_variables_are_ignored_unless_enabled with HTTP_PROXY set"]
    async fn proxy_child() {
        assert!(std::env::var("HTTP_PROXY").is_ok());
        let (server, _) = redirector(200, String::new()).await;
        let direct = PrivateAccess::everything().client(false, Duration::from_secs(5)).unwrap();
        assert_eq!(direct.get(format!("http://{server}/")).send().await.unwrap().status(), 200);
        // Through the proxy (a documentation address nothing answers) the call fails.
        let proxied = PrivateAccess::everything().client(true, Duration::from_secs(2)).unwrap();
        assert!(proxied.get(format!("http://{server}/")).send().await.is_err(), "the proxy was not used");
    }
}
