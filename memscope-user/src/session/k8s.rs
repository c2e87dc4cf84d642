//! The Kubernetes pod and container of a traced process, from the node's own records
//! (`memscope_core::cluster::pod` reads them): its cgroup path names its pod's UID and its
//! container's id; the container runtime's config of that container names the pod and the
//! container, and else the kubelet's log folder names the pod. No API server is asked, so this
//! works on an air-gapped node and costs a few small reads per traced process.
//!
//! The records are read under `--node-root` (default `/`): the daemon in a container sees the
//! node's `/run` and `/var/log` where its DaemonSet mounts them.

use std::path::Path;

use memscope_core::cluster::pod::{self, Pod};

/// Where each runtime keeps a container's OCI config, `{id}` its id: containerd's CRI plugin,
/// then CRI-O's two storage roots.
const RUNTIME_CONFIGS: &[&str] = &[
    "run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
    "run/containers/storage/overlay-containers/{id}/userdata/config.json",
    "var/lib/containers/storage/overlay-containers/{id}/userdata/config.json",
];

/// The kubelet's log folders, one per pod: `<namespace>_<pod>_<uid>/<container>/`.
const POD_LOGS: &str = "var/log/pods";

/// The pod `pid` runs in, as the node's records under `node_root` name it; `None` for a process
/// outside any pod, or a pod the node has no record of.
pub fn pod_of(pid: u32, node_root: &Path) -> Option<Pod> {
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let found = pod::pod_of_cgroup(&cgroup)?;
    if let Some(id) = &found.container_id {
        let configs = RUNTIME_CONFIGS.iter().map(|c| node_root.join(c.replace("{id}", id)));
        if let Some(pod) = configs
            .filter_map(|c| std::fs::read_to_string(c).ok())
            .find_map(|text| pod::pod_of_runtime_config(&text, &found.uid))
        {
            return Some(pod);
        }
    }
    from_logs(&node_root.join(POD_LOGS), &found.uid)
}

/// The pod from its log folder; the container too when the pod has only one.
fn from_logs(logs: &Path, uid: &str) -> Option<Pod> {
    let (dir, (namespace, name)) = std::fs::read_dir(logs)
        .ok()?
        .filter_map(Result::ok)
        .find_map(|e| Some((e.path(), pod::pod_of_log_dir(e.file_name().to_str()?, uid)?)))?;
    let containers: Vec<String> = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.path().is_dir())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    let container = (containers.len() == 1).then(|| containers[0].clone());
    Some(Pod { namespace, name, container, uid: uid.to_owned() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pods_log_folder_names_it_and_its_only_container() {
        let root = std::env::temp_dir().join(format!("memscope-k8s-{}", std::process::id()));
        let uid = "0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b";
        let pod = root.join(POD_LOGS).join(format!("ml_llama-0_{uid}"));
        std::fs::create_dir_all(pod.join("trainer")).unwrap();
        std::fs::create_dir_all(root.join(POD_LOGS).join("kube-system_other_1234")).unwrap();
        let found = from_logs(&root.join(POD_LOGS), uid).unwrap();
        assert_eq!(
            (found.namespace.as_str(), found.name.as_str(), found.container.as_deref()),
            ("ml", "llama-0", Some("trainer"))
        );
        std::fs::create_dir_all(pod.join("sidecar")).unwrap();
        assert_eq!(from_logs(&root.join(POD_LOGS), uid).unwrap().container, None, "two containers: not known which");
        assert!(from_logs(&root.join(POD_LOGS), "another").is_none());
        let _ = std::fs::remove_dir_all(&root);
    }
}
