//! Which Kubernetes pod and container a process runs in, from the node alone (no API server):
//! the process's cgroup path names its pod's UID and its container's id, and the node keeps
//! records of both — the container runtime's config of each container (containerd's and
//! CRI-O's, whose annotations carry the pod's namespace and name and the container's name) and
//! the kubelet's log folders (`/var/log/pods/<namespace>_<pod>_<uid>/<container>/`).
//!
//! This module reads the texts; the binary finds the files (`--node-root`).

/// A pod's UID and the container's id, as a process's cgroup path names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRef {
    pub uid: String,
    pub container_id: Option<String>,
}

/// A pod as the node's records name it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pod {
    pub namespace: String,
    pub name: String,
    pub container: Option<String>,
    pub uid: String,
}

/// The pod in `/proc/PID/cgroup`'s text: the kubelet's cgroups put each pod under
/// `kubepods…/pod<uid>` (the cgroupfs driver) or `kubepods-<qos>-pod<uid with _>.slice` (the
/// systemd driver), each container below as its runtime's id (`<id>`, `cri-containerd-<id>.scope`,
/// `crio-<id>.scope`, `docker-<id>.scope`).
pub fn pod_of_cgroup(cgroup: &str) -> Option<PodRef> {
    let path = cgroup.lines().find_map(|l| l.splitn(3, ':').nth(2).filter(|p| p.contains("kubepods")))?;
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let at = parts.iter().rposition(|p| pod_uid(p).is_some())?;
    let uid = pod_uid(parts[at])?;
    let container_id = parts.get(at + 1).and_then(|c| container_id(c));
    Some(PodRef { uid, container_id })
}

/// `pod<uid>` or `kubepods-<qos>-pod<uid_with_underscores>.slice`.
fn pod_uid(part: &str) -> Option<String> {
    let part = part.strip_suffix(".slice").unwrap_or(part);
    let (before, uid) = part.rsplit_once("pod")?;
    if !(before.is_empty() || before.ends_with('-')) {
        return None;
    }
    let uid = uid.replace('_', "-");
    (uid.len() == 36 && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-')).then_some(uid)
}

fn container_id(part: &str) -> Option<String> {
    let part = part.strip_suffix(".scope").unwrap_or(part);
    let id = ["cri-containerd-", "crio-", "docker-", "cri-dockerd-"]
        .iter()
        .find_map(|p| part.strip_prefix(p))
        .unwrap_or(part);
    (id.len() == 64 && id.chars().all(|c| c.is_ascii_hexdigit())).then(|| id.to_owned())
}

/// The pod a container runtime's config of one container (an OCI runtime spec) names by its
/// annotations: containerd's CRI plugin (`io.kubernetes.cri.*`) or CRI-O (`io.kubernetes.*`).
pub fn pod_of_runtime_config(json: &str, uid: &str) -> Option<Pod> {
    let spec: serde_json::Value = serde_json::from_str(json).ok()?;
    let notes = spec.get("annotations")?;
    let get = |keys: &[&str]| keys.iter().find_map(|k| notes.get(*k)?.as_str().map(str::to_owned));
    let namespace = get(&["io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"])?;
    let name = get(&["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"])?;
    let container = get(&["io.kubernetes.cri.container-name", "io.kubernetes.container.name"]);
    Some(Pod { namespace, name, container, uid: uid.to_owned() })
}

/// The namespace and name in a kubelet log folder's name, `<namespace>_<name>_<uid>`, when it
/// is `uid`'s (neither a namespace nor a pod's name may hold `_`).
pub fn pod_of_log_dir(dir_name: &str, uid: &str) -> Option<(String, String)> {
    let mut parts = dir_name.split('_');
    let (namespace, name, of) = (parts.next()?, parts.next()?, parts.next()?);
    (parts.next().is_none() && of == uid && !namespace.is_empty() && !name.is_empty())
        .then(|| (namespace.to_owned(), name.to_owned()))
}

impl Pod {
    /// Its `ms_meta` keys.
    pub fn meta(&self) -> Vec<(String, String)> {
        let mut meta = vec![
            ("k8s_namespace".to_owned(), self.namespace.clone()),
            ("k8s_pod".to_owned(), self.name.clone()),
            ("k8s_pod_uid".to_owned(), self.uid.clone()),
        ];
        meta.extend(self.container.clone().map(|c| ("k8s_container".to_owned(), c)));
        meta
    }

    /// Its metric labels: `namespace`, `pod`, and `container` when known.
    pub fn labels(&self) -> Vec<(&'static str, String)> {
        let mut labels = vec![("namespace", self.namespace.clone()), ("pod", self.name.clone())];
        labels.extend(self.container.clone().map(|c| ("container", c)));
        labels
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b";
    const CID: &str = "9a8b7c6d5e4f30211203f4e5d6c7b8a99a8b7c6d5e4f30211203f4e5d6c7b8a9";

    #[test]
    fn a_pods_uid_and_container_come_from_either_cgroup_drivers_path() {
        let systemd = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{CID}.scope\n",
            UID.replace('-', "_")
        );
        let want = Some(PodRef { uid: UID.into(), container_id: Some(CID.into()) });
        assert_eq!(pod_of_cgroup(&systemd), want);
        let cgroupfs =
            format!("12:memory:/kubepods/besteffort/pod{UID}/{CID}\n0::/kubepods/besteffort/pod{UID}/{CID}\n");
        assert_eq!(pod_of_cgroup(&cgroupfs), want);
        let guaranteed = format!("0::/kubepods.slice/kubepods-pod{}.slice/crio-{CID}.scope", UID.replace('-', "_"));
        assert_eq!(pod_of_cgroup(&guaranteed), want);
        let pause_only = format!("0::/kubepods/pod{UID}");
        assert_eq!(pod_of_cgroup(&pause_only), Some(PodRef { uid: UID.into(), container_id: None }));
        assert_eq!(pod_of_cgroup("0::/user.slice/user-0.slice/session-1.scope"), None);
        assert_eq!(pod_of_cgroup("0::/kubepods/podnot-a-uid/x"), None);
    }

    #[test]
    fn the_runtimes_annotations_and_the_kubelets_log_folders_name_the_pod() {
        let containerd = r#"{"ociVersion":"1.1.0","annotations":{"io.kubernetes.cri.container-name":"trainer",
            "io.kubernetes.cri.sandbox-name":"llama-0","io.kubernetes.cri.sandbox-namespace":"ml"}}"#;
        let pod = pod_of_runtime_config(containerd, UID).unwrap();
        assert_eq!(
            (pod.namespace.as_str(), pod.name.as_str(), pod.container.as_deref()),
            ("ml", "llama-0", Some("trainer"))
        );
        let crio = r#"{"annotations":{"io.kubernetes.pod.namespace":"ml","io.kubernetes.pod.name":"llama-1",
            "io.kubernetes.container.name":"trainer"}}"#;
        assert_eq!(pod_of_runtime_config(crio, UID).unwrap().name, "llama-1");
        assert_eq!(pod_of_runtime_config(r#"{"annotations":{}}"#, UID), None);
        assert_eq!(pod_of_runtime_config("not json", UID), None);
        assert_eq!(pod_of_log_dir(&format!("ml_llama-0_{UID}"), UID), Some(("ml".into(), "llama-0".into())));
        assert_eq!(pod_of_log_dir("ml_llama-0_another-uid", UID), None);
        assert_eq!(
            pod.labels(),
            [("namespace", "ml".into()), ("pod", "llama-0".into()), ("container", "trainer".into())]
        );
        assert_eq!(pod.meta().len(), 4);
    }
}
