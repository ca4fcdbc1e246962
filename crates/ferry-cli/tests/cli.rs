//! Runs the real `ferry` binary. Inside the soft-RoCE VM (`FERRY_RXE=1`, with
//! `FERRY_BIN` naming the binary there) the same tests expect the device.

use std::process::{Command, Output};

fn ferry(args: &[&str]) -> Output {
    let bin =
        std::env::var("FERRY_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_ferry").to_string());
    Command::new(bin)
        .args(args)
        .output()
        .expect("run the ferry binary")
}

fn in_rxe_vm() -> bool {
    std::env::var_os("FERRY_RXE").is_some()
}

#[test]
fn info_json_lists_the_transports_that_can_start_here() {
    let out = ferry(&["info", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("info --json is JSON");
    let transport = |name: &str| {
        info["transports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .cloned()
            .unwrap()
    };
    assert_eq!(transport("tcp")["available"], true);
    let ibverbs = transport("ibverbs");
    let devices = info["devices"].as_array().unwrap();
    if in_rxe_vm() {
        assert_eq!(ibverbs["available"], true, "{ibverbs}");
        let rxe = devices
            .iter()
            .find(|d| d["name"] == "rxe0")
            .expect("rxe0 listed");
        let port = &rxe["ports"][0];
        assert_eq!(port["active"], true);
        assert_eq!(port["link_layer"], "Ethernet");
        let gids = port["gids"].as_array().unwrap();
        assert!(
            gids.iter().any(
                |g| g["kind"] == "RoCE v2" && g["gid"].as_str().unwrap().starts_with("::ffff:")
            ),
            "{gids:?}"
        );
    } else if ibverbs["available"] == false {
        // A host without a NIC: the reason is given, and no device is listed.
        assert!(!ibverbs["detail"].as_str().unwrap().is_empty());
        assert!(devices.is_empty());
    }
}

#[test]
fn info_as_text_says_why_a_transport_cannot_start() {
    let out = ferry(&["info"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("tcp      available"), "{text}");
    assert!(
        text.contains("ibverbs  available") || text.contains("ibverbs  unavailable: "),
        "{text}"
    );
}

#[test]
fn disabling_ibverbs_is_reported() {
    let bin =
        std::env::var("FERRY_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_ferry").to_string());
    let out = Command::new(bin)
        .args(["info", "--json"])
        .env("FERRY_DISABLE_IBVERBS", "1")
        .output()
        .unwrap();
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ibverbs = info["transports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "ibverbs")
        .unwrap()
        .clone();
    assert_eq!(ibverbs["available"], false);
    assert_eq!(ibverbs["detail"], "disabled by FERRY_DISABLE_IBVERBS=1");
}

#[test]
fn bad_arguments_fail_cleanly() {
    for args in [&["info", "--bogus"][..], &["frobnicate"][..], &[][..]] {
        let out = ferry(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with("error: ") || stderr.contains("Usage:"),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains("panicked") && !stderr.contains("backtrace"),
            "{args:?}: {stderr}"
        );
    }
    assert!(ferry(&["info", "--help"]).status.success());
    assert!(ferry(&["--help"]).status.success());
}
