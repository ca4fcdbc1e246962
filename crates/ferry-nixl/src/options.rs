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
    /// Each transfer's deadline: NIXL has none of its own, so a stopped
    /// peer would keep a request in progress forever.
    pub deadline: Duration,
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
        "deadline_ms",
        "30000",
        "each transfer's deadline: ERR from check_xfer_state past it",
    ),
];

impl Options {
    /// Parses NIXL's parameters; an unknown key or a bad value is an error
    /// naming it, so a typo does not silently fall back to a default.
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
        let get = |key: &str| {
            params
                .get(key)
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
    }

    #[test]
    fn options_are_parsed_and_bad_ones_named() {
        let options = Options::parse(&params(&[
            ("transports", "tcp"),
            ("deadline_ms", "1500"),
            ("tcp_connections", "2"),
        ]))
        .unwrap();
        assert!(options.tcp && !options.memory && !options.ibverbs);
        assert_eq!(options.deadline, Duration::from_millis(1500));
        assert_eq!(options.tcp_connections, Some(2));
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
