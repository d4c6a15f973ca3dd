//! Unit tests of the sandbox; most need bubblewrap (scripts/setup.sh installs it).

use super::*;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kedge-sbx-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// The sandbox under test; these tests need bubblewrap (scripts/setup.sh installs it).
async fn bwrap() -> Bubblewrap {
    Bubblewrap::probe()
        .await
        .expect("bubblewrap works here (scripts/setup.sh installs it)")
}

#[tokio::test]
async fn no_network_inside() {
    let sb = bwrap().await;
    let ws = tmp("net");
    // `cat` of bash's /dev/tcp is the only socket a shell can open without a client program.
    let done = execute(
        &sb,
        "bash",
        &args(&[
            "-c",
            "echo > /dev/tcp/1.1.1.1/53 && echo CONNECTED; cat /proc/net/dev",
        ]),
        &ws,
        Duration::from_secs(5),
        4096,
    )
    .await
    .expect("ran");
    let out = String::from_utf8_lossy(&done.stdout);
    assert!(!out.contains("CONNECTED"), "{out}");
    // Only a loopback interface exists.
    let ifaces: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim()))
        .filter(|n| !n.contains('|'))
        .collect();
    assert_eq!(ifaces, vec!["lo"], "{out}");
    // Unconfined, the same host does have other interfaces (or the check above proves nothing).
    let host = std::fs::read_to_string("/proc/net/dev").expect("host interfaces");
    assert!(host.lines().count() > 3, "{host}");
    let _ = std::fs::remove_dir_all(&ws);
}

#[tokio::test]
async fn the_file_system_is_the_workspace_and_usr() {
    let sb = bwrap().await;
    let ws = tmp("fs");
    std::fs::write(ws.join("mine"), "inside").expect("write");
    let done = execute(
        &sb,
        "ls",
        &args(&["/", "/etc"]),
        &ws,
        Duration::from_secs(5),
        4096,
    )
    .await
    .expect("ran");
    let out = String::from_utf8_lossy(&done.stdout);
    for absent in ["home", "root", "work", "passwd", "shadow", "hostname"] {
        assert!(!out.lines().any(|l| l == absent), "{absent} visible: {out}");
    }
    let done = execute(
        &sb,
        "cat",
        &args(&["mine"]),
        &ws,
        Duration::from_secs(5),
        4096,
    )
    .await
    .expect("ran");
    assert_eq!(done.stdout, b"inside");
    let _ = std::fs::remove_dir_all(&ws);
}

#[tokio::test]
async fn limits_apply_inside() {
    let sb = bwrap().await;
    let ws = tmp("limits");
    let done = execute(
        &sb,
        "cat",
        &args(&["/proc/self/limits"]),
        &ws,
        Duration::from_secs(3),
        8192,
    )
    .await
    .expect("ran");
    let out = String::from_utf8_lossy(&done.stdout);
    let limit = |name: &str| {
        out.lines()
            .find(|l| l.starts_with(name))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    assert!(limit("Max cpu time").contains(" 4 4 "), "{out}");
    assert!(
        limit("Max file size").contains(&format!(" {} ", 64 << 20)),
        "{out}"
    );
    assert!(
        limit("Max address space").contains(&format!(" {} ", 1u64 << 30)),
        "{out}"
    );
    assert!(limit("Max processes").contains(" 64 64 "), "{out}");
    // A file cannot grow past the size limit (SIGXFSZ).
    let done = execute(
        &sb,
        "bash",
        &args(&["-c", "head -c 70000000 /dev/zero > big"]),
        &ws,
        Duration::from_secs(5),
        4096,
    )
    .await
    .expect("ran");
    assert!(
        matches!(done.ended, Ended::Exited(s) if !s.success()),
        "{done:?}"
    );
    let size = std::fs::metadata(ws.join("big")).expect("big").len();
    assert_eq!(size, 64 << 20);
    let _ = std::fs::remove_dir_all(&ws);
}

#[tokio::test]
async fn output_is_capped_while_read_and_the_group_is_killed() {
    for sb in [&bwrap().await as &dyn Sandbox, &Unconfined] {
        let ws = tmp("cap");
        let started = std::time::Instant::now();
        let done = execute(sb, "yes", &[], &ws, Duration::from_secs(20), 10_000)
            .await
            .expect("ran");
        assert_eq!(done.ended, Ended::OverCap, "{}", sb.name());
        assert!(done.stdout.len() <= 10_000 + 8192, "{}", done.stdout.len());
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let _ = std::fs::remove_dir_all(&ws);
    }
}

#[tokio::test]
async fn the_whole_group_dies_at_the_timeout_even_unconfined() {
    let marker = format!("4{}.75", std::process::id() % 1000);
    for sb in [&bwrap().await as &dyn Sandbox, &Unconfined] {
        let ws = tmp("group");
        let script = format!("sleep {marker} & sleep {marker}");
        let done = execute(
            sb,
            "sh",
            &args(&["-c", &script]),
            &ws,
            Duration::from_millis(300),
            4096,
        )
        .await
        .expect("ran");
        assert_eq!(done.ended, Ended::TimedOut, "{}", sb.name());
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        while sleeping(&marker) {
            assert!(
                std::time::Instant::now() < deadline,
                "{}: a sleep outlived its command",
                sb.name()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = std::fs::remove_dir_all(&ws);
    }
}

#[tokio::test]
async fn a_server_gets_its_env_its_read_only_paths_and_no_cpu_limit() {
    let sb = bwrap().await;
    let ws = tmp("server");
    let shown = tmp("server-ro");
    std::fs::write(shown.join("data"), "readable\n").expect("write");
    let env = BTreeMap::from([("GIVEN".to_owned(), "yes".to_owned())]);
    let read_only = [shown.clone()];
    let script = format!(
        "echo \"$GIVEN\"; cat {0}/data; echo x > {0}/data || echo RO; grep 'Max cpu time' /proc/self/limits",
        shown.display()
    );
    let mut cmd = sb.command_with(
        "bash",
        &args(&["-c", &script]),
        &ws,
        &Limits::for_server(false),
        &Extra {
            read_only: &read_only,
            env: &env,
        },
    );
    let out = cmd.output().await.expect("ran");
    let out = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..3], ["yes", "readable", "RO"], "{out}");
    // Not the shell's `--cpu`: inherited from this process (unlimited in a test).
    let host = std::fs::read_to_string("/proc/self/limits").expect("limits");
    let host_cpu = host
        .lines()
        .find(|l| l.starts_with("Max cpu time"))
        .unwrap_or("");
    assert_eq!(
        lines[3].split_whitespace().collect::<Vec<_>>(),
        host_cpu.split_whitespace().collect::<Vec<_>>(),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(shown.join("data")).expect("data"),
        "readable\n"
    );
    let _ = std::fs::remove_dir_all(&ws);
    let _ = std::fs::remove_dir_all(&shown);
}

/// Whether a process running `sleep <marker>` is alive.
fn sleeping(marker: &str) -> bool {
    let wanted = format!("sleep\0{marker}");
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .any(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(&wanted))
                .unwrap_or(false)
        })
}
