//! The DaemonSet's container image, as an OCI image layout written directly (the format is a
//! folder of JSON and content-addressed blobs: image-spec's image-layout.md, manifest.md,
//! config.md), with no base image and no container engine: one layer holding the static binary
//! and the folders the DaemonSet mounts over.
//!
//! `index.json` names one multi-architecture image index `VERSION` (what a registry push with
//! `skopeo copy --all` takes) and each architecture's manifest as `VERSION-amd64` and
//! `VERSION-arm64` (what a per-machine tool such as `umoci unpack` takes). The same folder as a
//! tar is what `podman load`, `docker load` and `ctr images import` read.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde_json::{json, Value};

use super::archive::{self, Content, Entry};

const INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// Where the binary sits in the image (the entrypoint).
pub const BINARY: &str = "/usr/local/bin/memscope-bpf";

pub struct Image {
    /// The OCI architecture name (`amd64`, `arm64`).
    pub arch: &'static str,
    pub binary: PathBuf,
}

/// A blob written under `blobs/sha256/`, returned as its descriptor.
fn blob(layout: &Path, media_type: &str, data: &[u8]) -> anyhow::Result<Value> {
    let digest = archive::sha256(data);
    let dir = layout.join("blobs/sha256");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(&digest), data)?;
    Ok(json!({ "mediaType": media_type, "digest": format!("sha256:{digest}"), "size": data.len() }))
}

/// The root file system: the binary, and the folders the DaemonSet mounts (`/var/lib/memscope`,
/// `/etc/memscope`, /sys's, the node's records under `/host`) or a runtime mounts (`/proc`, `/dev`), so that a read-only root works.
fn rootfs(binary: &Path) -> Vec<Entry> {
    let mut entries: Vec<Entry> = ["dev", "etc", "etc/memscope", "proc", "sys", "usr", "usr/local", "usr/local/bin"]
        .iter()
        .map(|d| Entry::dir(d, 0o755))
        .collect();
    entries.push(Entry {
        path: BINARY.trim_start_matches('/').to_owned(),
        mode: 0o755,
        content: Content::File(binary.to_owned()),
    });
    entries.push(Entry::dir("tmp", 0o1777));
    entries.extend(["var", "var/lib", "var/lib/memscope"].iter().map(|d| Entry::dir(d, 0o755)));
    // `--node-root=/host`: the node's container records, for the pods' names.
    let host = ["host", "host/run", "host/run/containerd", "host/var", "host/var/log", "host/var/log/pods"];
    entries.extend(host.iter().map(|d| Entry::dir(d, 0o755)));
    entries
}

/// One architecture's manifest (its layer and config written as blobs), as a descriptor.
fn manifest(layout: &Path, version: &str, image: &Image, mtime: u64) -> anyhow::Result<Value> {
    let tar = archive::tar(&rootfs(&image.binary), mtime)?;
    let layer = blob(layout, LAYER, &archive::gzip(&tar)?)?;
    let config = json!({
        "architecture": image.arch,
        "os": "linux",
        "config": {
            "Entrypoint": [BINARY],
            "Cmd": ["daemon", "--output=/var/lib/memscope"],
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
            "WorkingDir": "/",
            "Labels": { "org.opencontainers.image.title": "memscope-bpf", "org.opencontainers.image.version": version },
        },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{}", archive::sha256(&tar))] },
        "history": [{ "created_by": "cargo xtask dist" }],
    });
    let config = blob(layout, CONFIG, &serde_json::to_vec(&config)?)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": config,
        "layers": [layer],
        "annotations": { "org.opencontainers.image.version": version },
    });
    let mut descriptor = blob(layout, MANIFEST, &serde_json::to_vec(&manifest)?)?;
    descriptor["platform"] = json!({ "architecture": image.arch, "os": "linux" });
    Ok(descriptor)
}

/// Writes the layout into `layout` (emptied first).
pub fn write(layout: &Path, version: &str, images: &[Image], mtime: u64) -> anyhow::Result<()> {
    let _ = std::fs::remove_dir_all(layout);
    std::fs::create_dir_all(layout).with_context(|| format!("cannot create {}", layout.display()))?;
    let manifests = images.iter().map(|i| manifest(layout, version, i, mtime)).collect::<anyhow::Result<Vec<_>>>()?;
    let all = json!({ "schemaVersion": 2, "mediaType": INDEX, "manifests": manifests });
    let mut all = blob(layout, INDEX, &serde_json::to_vec(&all)?)?;
    all["annotations"] = json!({ REF_NAME: version });
    let mut entries = vec![all];
    for (manifest, image) in manifests.into_iter().zip(images) {
        let mut tagged = manifest;
        tagged["annotations"] = json!({ REF_NAME: format!("{version}-{}", image.arch) });
        entries.push(tagged);
    }
    let index = json!({ "schemaVersion": 2, "mediaType": INDEX, "manifests": entries });
    std::fs::write(layout.join("index.json"), serde_json::to_vec_pretty(&index)?)?;
    std::fs::write(layout.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    Ok(())
}
