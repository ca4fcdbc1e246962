//! The backend options NIXL passes (`create_backend("FERRY", {...})`), each
//! with a default, so that `create_backend("FERRY", {})` works.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

/// What the engine is configured with.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Same-host memory between agents of one host.
    pub memory: bool,
    /// ibverbs where both ends have a device.
    pub ibverbs: bool,
    /// TCP for everything else.
    pub tcp: bool,
    /// The address the node's endpoint binds.
    pub listen: SocketAddr,
    /// The address peers reach it at, if not `listen`.
    pub advertise: Option<SocketAddr>,
    /// TCP data connections per peer, if not ferry's default.
    pub tcp_connections: Option<usize>,
    /// How long a TCP data connection polls for answers before it sleeps.
    /// None by default, unlike a ferry node's 100 µs: NIXL's caller spins
    /// in checkXfer on one core already, and a second spinner took the
    /// core the peer's worker needed (an 8-byte write's p50 through NIXL
    /// was 285 µs with ferry's window, 96 without).
    pub tcp_busy_poll: Duration,
    /// Each transfer's deadline: NIXL has none of its own, so a stopped
    /// peer would keep a request in progress forever.
    pub deadline: Duration,
    /// The file holding the cluster secret every peer must prove, if any
    /// (else ferry's own `FERRY_CLUSTER_SECRET`, if set).
    pub cluster_secret_file: Option<std::path::PathBuf>,
}

/// Every option, its default, and what it means: `get_plugin_params`.
pub const DEFAULTS: &[(&str, &str, &str)] = &[
    (
        "transports",
        "memory,ibverbs,tcp",
        "transports the node may use, fastest first",
    ),
    ("listen", "127.0.0.1:0", "address the node's endpoint binds"),
    (
        "advertise",
        "",
        "address peers reach it at (needed with an unspecified listen address)",
    ),
    (
        "tcp_connections",
        "",
        "TCP data connections per peer (ferry's default if empty)",
    ),
    (
        "tcp_busy_poll_us",
        "0",
        "microseconds a TCP data connection polls for answers before it sleeps",
    ),
    (
        "cluster_secret_file",
        "",
        "file holding the cluster secret every peer must prove (none if empty)",
    ),
    (
        "deadline_ms",
        "30000",
        "each transfer's deadline: ERR from check_xfer_state past it",
    ),
];

impl Options {
    /// Parses NIXL's parameters; an unknown key or a bad value is an error
    /// naming it, so a typo does not silently fall back to a default.
    ///
    /// A key NIXL did not pass is read from the environment
    /// (`FERRY_NIXL_<KEY>`, e.g. `FERRY_NIXL_DEADLINE_MS`) before its
    /// default: vLLM and SGLang create their backends without parameters,
    /// so the environment is the only way their users can set one.
    pub fn parse(params: &HashMap<String, String>) -> Result<Options, String> {
        if let Some(key) = params
            .keys()
            .find(|k| !DEFAULTS.iter().any(|(name, _, _)| name == k))
        {
            let known: Vec<&str> = DEFAULTS.iter().map(|(name, _, _)| *name).collect();
            return Err(format!(
                "unknown option {key:?} (known: {})",
                known.join(", ")
            ));
        }
        Options::parse_with(params, |key| std::env::var(env_name(key)).ok())
    }

    /// [`Options::parse`] with `env` standing in for the environment.
    fn parse_with(
        params: &HashMap<String, String>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Options, String> {
        let from_env: HashMap<&str, String> = DEFAULTS
            .iter()
            .filter_map(|(key, _, _)| Some((*key, env(key)?)))
            .collect();
        let get = |key: &str| {
            params
                .get(key)
                .or_else(|| from_env.get(key))
                .map(String::as_str)
                .or_else(|| DEFAULTS.iter().find(|d| d.0 == key).map(|d| d.1))
                .unwrap_or("")
                .trim()
        };
        let bad = |key: &str, e: &dyn std::fmt::Display| format!("option {key}: {e}");
        let mut options = Options {
            memory: false,
            ibverbs: false,
            tcp: false,
            listen: get("listen").parse().map_err(|e| bad("listen", &e))?,
            advertise: match get("advertise") {
                "" => None,
                a => Some(a.parse().map_err(|e| bad("advertise", &e))?),
            },
            tcp_connections: match get("tcp_connections") {
                "" => None,
                n => Some(n.parse().map_err(|e| bad("tcp_connections", &e))?),
            },
            tcp_busy_poll: Duration::from_micros(
                get("tcp_busy_poll_us")
                    .parse()
                    .map_err(|e| bad("tcp_busy_poll_us", &e))?,
            ),
            cluster_secret_file: match get("cluster_secret_file") {
                "" => None,
                path => Some(path.into()),
            },
            deadline: Duration::from_millis(
                get("deadline_ms")
                    .parse()
                    .map_err(|e| bad("deadline_ms", &e))?,
            ),
        };
        for transport in get("transports").split(',').map(str::trim) {
            match transport {
                "memory" => options.memory = true,
                "ibverbs" => options.ibverbs = true,
                "tcp" => options.tcp = true,
                other => return Err(format!("option transports: unknown transport {other:?}")),
            }
        }
        if !options.tcp && !options.memory && !options.ibverbs {
            return Err("option transports: none named".into());
        }
        if options.deadline.is_zero() {
            return Err("option deadline_ms: must be at least 1".into());
        }
        Ok(options)
    }
}

/// The environment variable that sets option `key` where NIXL passes none.
pub fn env_name(key: &str) -> String {
    format!("FERRY_NIXL_{}", key.to_ascii_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn no_options_is_every_transport_on_loopback_with_a_deadline() {
        let options = Options::parse(&HashMap::new()).unwrap();
        assert!(options.memory && options.ibverbs && options.tcp);
        assert_eq!(options.listen, "127.0.0.1:0".parse().unwrap());
        assert_eq!(options.advertise, None);
        assert_eq!(options.deadline, Duration::from_secs(30));
        assert_eq!(options.tcp_busy_poll, Duration::ZERO);
    }

    #[test]
    fn options_are_parsed_and_bad_ones_named() {
        let options = Options::parse(&params(&[
            ("transports", "tcp"),
            ("deadline_ms", "1500"),
            ("tcp_connections", "2"),
            ("tcp_busy_poll_us", "20"),
        ]))
        .unwrap();
        assert!(options.tcp && !options.memory && !options.ibverbs);
        assert_eq!(options.deadline, Duration::from_millis(1500));
        assert_eq!(options.tcp_connections, Some(2));
        assert_eq!(options.tcp_busy_poll, Duration::from_micros(20));
        let env = |key: &str| match key {
            "deadline_ms" => Some("2500".to_string()),
            "transports" => Some("tcp".to_string()),
            _ => None,
        };
        let from_env = Options::parse_with(&params(&[("transports", "memory")]), env).unwrap();
        assert_eq!(from_env.deadline, Duration::from_millis(2500));
        assert!(
            from_env.memory && !from_env.tcp,
            "a parameter beats the environment"
        );
        for (pairs, names) in [
            (&[("transport", "tcp")][..], "transport"),
            (&[("transports", "udp")][..], "udp"),
            (&[("transports", "")][..], "transports"),
            (&[("deadline_ms", "0")][..], "deadline_ms"),
            (&[("listen", "nowhere")][..], "listen"),
        ] {
            let error = Options::parse(&params(pairs)).unwrap_err();
            assert!(error.contains(names), "{pairs:?}: {error}");
        }
    }
}
