//! The release `cargo xtask dist` writes (target/dist/), checked with the tools users will take
//! to it: `sha256sum -c`, readelf, gdb, pip in a fresh venv, qemu-user for the aarch64 files, and
//! umoci for the OCI image, whose binary then traces a stand-in job of the host from inside the
//! image's root file system (as the DaemonSet's container does), checked against the job's
//! ledger.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use memscope_integration::*;

const VERSION: &str = env!("CARGO_PKG_VERSION");
const ARCHES: [&str; 2] = ["x86_64", "aarch64"];

/// The dist folder, or a skip saying why there is none.
fn dist() -> Option<PathBuf> {
    match std::env::var_os("MEMSCOPE_DIST") {
        Some(d) if Path::new(&d).join("SHA256SUMS").is_file() => Some(PathBuf::from(d)),
        _ => {
            let why = std::env::var("MEMSCOPE_DIST_MISSING").unwrap_or_else(|_| "MEMSCOPE_DIST is not set".into());
            eprintln!("SKIPPED: no release to check ({why}); `cargo xtask test` builds it with `cargo xtask dist`");
            None
        }
    }
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed ({}):\n{text}", out.status);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn unpack(tarball: &Path, into: &Path) -> PathBuf {
    std::fs::create_dir_all(into).unwrap();
    run(Command::new("tar").arg("-xzf").arg(tarball).arg("-C").arg(into));
    into.join(tarball.file_name().unwrap().to_string_lossy().trim_end_matches(".tar.gz"))
}

/// What readelf says of a file's machine, interpreter and needed libraries.
fn assert_static_for(binary: &Path, machine: &str) {
    let header = run(Command::new("readelf").arg("-hlWd").arg(binary));
    assert!(
        header.lines().any(|l| l.contains("Machine:") && l.contains(machine)),
        "{}: not {machine}:\n{header}",
        binary.display()
    );
    assert!(!header.contains("INTERP"), "{} asks for a dynamic loader (so for a glibc version)", binary.display());
    assert!(!header.contains("(NEEDED)"), "{} needs shared libraries", binary.display());
}

/// The highest `GLIBC_x.y` a dynamic binary asks for, from its version needs.
fn newest_glibc(binary: &Path) -> (u32, u32) {
    let needs = run(Command::new("readelf").arg("-V").arg(binary));
    needs
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let (major, minor) = v.split_once('.')?;
            Some((major.parse().ok()?, minor.split('.').next()?.parse().ok()?))
        })
        .max()
        .unwrap_or_else(|| panic!("{} asks for no glibc version:\n{needs}", binary.display()))
}

/// The driver helper: built for `machine`, loading libraries (so dynamic), on glibc 2.28.
fn assert_helper_for(helper: &Path, machine: &str) {
    let header = run(Command::new("readelf").arg("-hlWd").arg(helper));
    assert!(
        header.lines().any(|l| l.contains("Machine:") && l.contains(machine)),
        "{}: not {machine}",
        helper.display()
    );
    assert!(header.contains("(NEEDED)"), "{} is not dynamic: it could not dlopen a driver library", helper.display());
    let newest = newest_glibc(helper);
    assert!(
        newest <= (2, 28),
        "{} needs GLIBC_{}.{}, newer than the release's 2.28",
        helper.display(),
        newest.0,
        newest.1
    );
}

#[test]
fn each_release_tarball_holds_a_static_binary_for_its_machine_the_docs_the_markers_and_true_checksums() {
    let Some(dist) = dist() else { return };
    let scratch = var("MEMSCOPE_SCRATCH").join("release_tarballs");
    let _ = std::fs::remove_dir_all(&scratch);
    run(Command::new("sha256sum").current_dir(&dist).args(["--check", "--strict", "SHA256SUMS"]));
    for (arch, machine) in ARCHES.into_iter().zip(["X86-64", "AArch64"]) {
        let name = format!("memscope-bpf-{VERSION}-{arch}-linux");
        let folder = unpack(&dist.join(format!("{name}.tar.gz")), &scratch);
        run(Command::new("sha256sum").current_dir(&folder).args(["--check", "--strict", "SHA256SUMS"]));
        let binary = folder.join("memscope-bpf");
        assert_static_for(&binary, machine);
        assert_helper_for(&folder.join("memscope-driver-query"), machine);
        for doc in ["README.md", "docs/deploy/daemonset.yaml", "docs/benchmarks.md"] {
            assert!(folder.join(doc).is_file(), "{name} lacks {doc}");
        }
        let markers: Vec<String> = std::fs::read_dir(folder.join("markers"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(markers.iter().any(|m| m.ends_with(".tar.gz")), "{name}: no markers sdist in {markers:?}");
        let wheels: Vec<&String> = markers.iter().filter(|m| m.ends_with(".whl")).collect();
        assert!(!wheels.is_empty(), "{name}: no markers wheel in {markers:?}");
        assert!(
            wheels.iter().all(|w| w.ends_with(&format!("_{arch}.whl"))),
            "{name}: another machine's wheel in {wheels:?}"
        );
        // The stripped binary names its debug file, and gdb finds main's line through it.
        let debug = dist.join(format!("{name}.debug"));
        let link = run(Command::new("readelf").args(["--string-dump=.gnu_debuglink"]).arg(&binary));
        assert!(link.contains(&format!("{name}.debug")), "{link}");
        // And both carry one build id, by which debuginfod and `/usr/lib/debug/.build-id/` find
        // the debug file, and a trace's frames in this binary are told apart from another build's.
        let ids: Vec<String> = [&binary, &debug]
            .iter()
            .map(|f| {
                let notes = run(Command::new("readelf").arg("-n").arg(f));
                let id = notes.lines().find_map(|l| l.trim().strip_prefix("Build ID: ").map(str::to_owned));
                id.unwrap_or_else(|| panic!("{} has no build id:\n{notes}", f.display()))
            })
            .collect();
        assert_eq!(ids[0], ids[1], "{name}: the binary's build id is not its debug file's");
        if arch == std::env::consts::ARCH {
            let pair = scratch.join(format!("gdb-{arch}"));
            std::fs::create_dir_all(&pair).unwrap();
            std::fs::copy(&binary, pair.join("memscope-bpf")).unwrap();
            std::fs::copy(&debug, pair.join(debug.file_name().unwrap())).unwrap();
            let line = run(Command::new("gdb")
                .args(["-nx", "-batch", "-ex", "info line memscope_bpf::main"])
                .arg(pair.join("memscope-bpf")));
            assert!(
                line.contains("memscope-user/src/main.rs"),
                "gdb did not find main's line through the debug file:\n{line}"
            );
        }
    }
}

/// `pip install` of the tracer's wheel for `arch` into `prefix` (a fresh venv for this machine's,
/// a `--target` folder for the other's); returns the installed script.
fn pip_install(dist: &Path, scratch: &Path, arch: &str) -> PathBuf {
    let wheel = dist.join(format!("memscope_bpf-{VERSION}-py3-none-manylinux_2_28_{arch}.whl"));
    let venv = scratch.join("venv");
    if !venv.exists() {
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv));
    }
    let pip = |args: &[&str]| {
        run(Command::new(venv.join("bin/python"))
            .args(["-m", "pip", "install", "--no-index", "--quiet"])
            .args(args)
            .arg(&wheel))
    };
    if arch == std::env::consts::ARCH {
        pip(&[]);
        return venv.join("bin/memscope-bpf");
    }
    let target = scratch.join(format!("target-{arch}"));
    let target_s = target.display().to_string();
    pip(&["--target", &target_s, "--platform", &format!("manylinux_2_28_{arch}"), "--only-binary=:all:", "--no-deps"]);
    target.join("bin/memscope-bpf")
}

/// The aarch64 binary runs under qemu-user; None after saying why when it is missing.
fn qemu_aarch64() -> Option<&'static str> {
    let qemu = "qemu-aarch64-static";
    if Command::new(qemu).arg("--version").output().is_ok_and(|o| o.status.success()) {
        Some(qemu)
    } else {
        eprintln!(
            "SKIPPED: the aarch64 binary's run: {qemu} is missing (`cargo xtask setup` installs qemu-user-static)"
        );
        None
    }
}

#[test]
fn the_release_wheels_install_with_pip_and_put_a_working_memscope_bpf_on_path() {
    let Some(dist) = dist() else { return };
    let scratch = var("MEMSCOPE_SCRATCH").join("release_wheels");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let native = pip_install(&dist, &scratch, std::env::consts::ARCH);
    let version = run(Command::new(&native).arg("--version"));
    assert_eq!(version.trim(), format!("memscope-bpf {VERSION}"));
    // A verb that does real work: the stand-in runtime's probe points, as the release binary sees them.
    let probes = run(Command::new(&native)
        .arg("probes")
        .arg("--lib")
        .arg(var("MEMSCOPE_ASCEND_HOME").join("lib64/libascendcl.so")));
    assert!(probes.contains("aclrtMalloc"), "{probes}");
    let other = if std::env::consts::ARCH == "x86_64" { "aarch64" } else { "x86_64" };
    let installed = pip_install(&dist, &scratch, other);
    assert!(installed.is_file(), "pip put no script at {}", installed.display());
    if other == "aarch64" {
        let Some(qemu) = qemu_aarch64() else { return };
        let version = run(Command::new(qemu).arg(&installed).arg("--version"));
        assert_eq!(version.trim(), format!("memscope-bpf {VERSION}"));
    }
}

#[test]
fn the_release_aarch64_binary_finds_in_aarch64_files_what_the_host_reads_in_them_as_aarch64() {
    let Some(dist) = dist() else { return };
    let Some(qemu) = qemu_aarch64() else { return };
    let scratch = var("MEMSCOPE_SCRATCH").join("release_aarch64");
    let _ = std::fs::remove_dir_all(&scratch);
    let folder = unpack(&dist.join(format!("memscope-bpf-{VERSION}-aarch64-linux.tar.gz")), &scratch);
    let arm = folder.join("memscope-bpf");
    // The markers' aarch64 extension, and the real torch_npu aarch64 library when it was fetched.
    let wheel = std::fs::read_dir(folder.join("markers"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with("_aarch64.whl"))
        .expect("an aarch64 markers wheel");
    run(Command::new("unzip").arg("-q").arg(&wheel).arg("-d").arg(scratch.join("markers")));
    let extension = std::fs::read_dir(scratch.join("markers/memscope"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with("-aarch64-linux-gnu.so"))
        .expect("the markers' aarch64 extension");
    let mut libs = vec![extension];
    match std::env::var_os("MEMSCOPE_REAL_TORCH_NPU_AARCH64") {
        Some(lib) => libs.push(PathBuf::from(lib)),
        None => eprintln!(
            "SKIPPED (part): the real aarch64 libtorch_npu.so is not here; only the markers' extension is read"
        ),
    }
    for lib in &libs {
        let on_arm = run(Command::new(qemu).arg(&arm).arg("probes").arg("--lib").arg(lib));
        let host =
            run(Command::new(var("MEMSCOPE_BIN")).arg("probes").arg("--lib").arg(lib).args(["--arch", "aarch64"]));
        let host: Vec<&str> = host.lines().filter(|l| !l.starts_with("read as aarch64 files")).collect();
        assert_eq!(on_arm.lines().collect::<Vec<_>>(), host, "{}", lib.display());
        assert!(on_arm.contains("    attach  "), "{}: nothing to attach:\n{on_arm}", lib.display());
    }
}

/// Runs `memscope-bpf` from the unpacked image's root file system, as its container would: in a
/// mount namespace where the root is the image's, with the host's /proc, /sys and /dev (the
/// DaemonSet's hostPID and mounts).
fn in_image(rootfs: &Path) -> Vec<String> {
    let script = r#"r="$1"; shift; for d in proc sys dev; do mount --rbind "/$d" "$r/$d" || exit 1; done; exec chroot "$r" "$@""#;
    ["unshare", "--mount", "--fork", "--kill-child", "--", "sh", "-c", script, "sh"]
        .iter()
        .map(|s| (*s).to_owned())
        .chain([rootfs.display().to_string()])
        .collect()
}

#[test]
fn the_release_oci_image_unpacks_with_umoci_and_its_binary_traces_a_host_job_from_inside() {
    let Some(dist) = dist() else { return };
    let mut env = env("release_image");
    let layout = dist.join("oci");
    for arch in ["amd64", "arm64"] {
        let bundle = env.scratch.join(format!("bundle-{arch}"));
        run(Command::new("umoci")
            .args(["unpack", "--image"])
            .arg(format!("{}:{VERSION}-{arch}", layout.display()))
            .arg(&bundle));
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
        assert_eq!(
            spec["process"]["args"],
            serde_json::json!(["/usr/local/bin/memscope-bpf", "daemon", "--output=/var/lib/memscope"])
        );
        assert_static_for(
            &bundle.join("rootfs/usr/local/bin/memscope-bpf"),
            if arch == "amd64" { "X86-64" } else { "AArch64" },
        );
    }
    // The multi-architecture index that a registry push takes names both manifests.
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let entries = index["manifests"].as_array().unwrap();
    let all = entries
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == VERSION)
        .expect("an index named VERSION");
    let digest = all["digest"].as_str().unwrap().trim_start_matches("sha256:");
    let nested: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("blobs/sha256").join(digest)).unwrap()).unwrap();
    let platforms: Vec<&str> = nested["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["platform"]["architecture"].as_str().unwrap())
        .collect();
    assert_eq!(platforms, ["amd64", "arm64"]);
    // The DaemonSet runs that image, under that tag.
    let daemonset =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/deploy/daemonset.yaml"))
            .unwrap();
    let image = daemonset.lines().find_map(|l| l.trim().strip_prefix("image: ")).expect("the DaemonSet names an image");
    assert!(image.ends_with(&format!("/memscope-bpf:{VERSION}")), "{image}");
    if std::env::consts::ARCH != "x86_64" {
        return eprintln!("SKIPPED (part): the image's trace runs on x86-64 hosts only");
    }
    let rootfs = env.scratch.join("bundle-amd64/rootfs");
    let ledger = env.scratch.join("ledger.jsonl");
    let mut workload = spawn_workload(&env, &ledger, &["--duration", "4", "--step-sleep-ms", "10", "--host", "--leak"]);
    std::thread::sleep(Duration::from_millis(1500));
    let start = wall_ns();
    let pid = workload.id().to_string();
    env.bin = PathBuf::from("/usr/local/bin/memscope-bpf");
    let wrapper = in_image(&rootfs);
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let mut tracer =
        Tracer::spawn_wrapped(&env, &wrapper, &["trace", "--pid", &pid, "--output", "/var/lib/memscope/out"], &[]);
    let live = tracer.wait_live(Duration::from_secs(30));
    assert_eq!(wait_child(&mut workload, Duration::from_secs(60)), 0);
    let (code, stderr) = tracer.finish(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{stderr}");
    let out = read_output(&rootfs.join("var/lib/memscope/out"));
    assert_attached(&read_ledger(&ledger), &out, start, live, u64::MAX);
    assert!(out.call_rows().len() > 50, "the image's binary recorded too little:\n{stderr}");
}
