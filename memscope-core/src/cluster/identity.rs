//! A traced process's place in a distributed job, from the variables its launcher set: its rank,
//! its rank on the node, the world's size, its device, and a job id that groups the ranks of one
//! launch. Read once from the process's environment; written to `ms_meta` (`rank`, `local_rank`,
//! `world_size`, `rank_device`, `job_id`) and used as the daemon's metric labels (`rank`,
//! `job_id`: Prometheus gives every scraped series a `job` label of its own, the scrape job's,
//! and would rename ours to `exported_job`).
//!
//! Launchers name these differently: torchrun (and vLLM's workers) set `RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR`/`MASTER_PORT` and `TORCHELASTIC_RUN_ID`; Ascend's launchers and
//! MindSpeed's scripts `RANK_ID`, `RANK_SIZE`, `DEVICE_ID`/`ASCEND_DEVICE_ID` and a
//! `RANK_TABLE_FILE` for HCCL. The first variable of each list that holds a value wins.

use std::collections::HashMap;

/// Where a process stands in its job; every part is absent when its launcher set none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identity {
    pub rank: Option<u32>,
    pub local_rank: Option<u32>,
    pub world_size: Option<u32>,
    /// The device its launcher gave it (`ASCEND_DEVICE_ID`, `DEVICE_ID`), as set.
    pub device: Option<String>,
    /// What the ranks of one launch share: torchrun's run id when one was given, else the
    /// rendezvous address (`MASTER_ADDR:MASTER_PORT`), else HCCL's rank table file.
    pub job: Option<String>,
}

const RANK: &[&str] = &["RANK", "RANK_ID"];
const LOCAL_RANK: &[&str] = &["LOCAL_RANK", "LOCAL_RANK_ID"];
const WORLD_SIZE: &[&str] = &["WORLD_SIZE", "RANK_SIZE"];
const DEVICE: &[&str] = &["ASCEND_DEVICE_ID", "DEVICE_ID"];

impl Identity {
    /// The identity its environment gives a process.
    pub fn from_env(env: &HashMap<String, String>) -> Self {
        let text = |names: &[&str]| names.iter().find_map(|n| env.get(*n).map(|v| v.trim()).filter(|v| !v.is_empty()));
        let number = |names: &[&str]| text(names).and_then(|v| v.parse::<u32>().ok());
        // torchrun sets TORCHELASTIC_RUN_ID to "none" unless --rdzv-id names the run.
        let run_id = text(&["TORCHELASTIC_RUN_ID"]).filter(|v| *v != "none").map(|v| format!("torchelastic:{v}"));
        let master = match (text(&["MASTER_ADDR"]), text(&["MASTER_PORT"])) {
            (Some(addr), Some(port)) => Some(format!("{addr}:{port}")),
            _ => None,
        };
        let table = text(&["RANK_TABLE_FILE"]).map(|v| format!("rank_table:{v}"));
        Self {
            rank: number(RANK),
            local_rank: number(LOCAL_RANK),
            world_size: number(WORLD_SIZE),
            device: text(DEVICE).map(str::to_owned),
            job: run_id.or(master).or(table),
        }
    }

    /// The identity a trace recorded in its `ms_meta` ([`Self::meta`]'s keys, read by `get`); a
    /// value that is not a number reads as absent.
    pub fn from_meta(mut get: impl FnMut(&str) -> Option<String>) -> Self {
        let mut number = |key: &str| get(key).and_then(|v| v.parse::<u32>().ok());
        let (rank, local_rank, world_size) = (number("rank"), number("local_rank"), number("world_size"));
        Self { rank, local_rank, world_size, device: get("rank_device"), job: get("job_id") }
    }

    /// Its `ms_meta` keys, only those known.
    pub fn meta(&self) -> Vec<(String, String)> {
        let mut meta = Vec::new();
        let mut put = |key: &str, value: Option<String>| {
            if let Some(v) = value {
                meta.push((key.to_owned(), v));
            }
        };
        put("rank", self.rank.map(|v| v.to_string()));
        put("local_rank", self.local_rank.map(|v| v.to_string()));
        put("world_size", self.world_size.map(|v| v.to_string()));
        put("rank_device", self.device.clone());
        put("job_id", self.job.clone());
        meta
    }

    /// Its metric labels: `rank` and `job_id`, each when known.
    pub fn labels(&self) -> Vec<(&'static str, String)> {
        let mut labels = Vec::new();
        if let Some(rank) = self.rank {
            labels.push(("rank", rank.to_string()));
        }
        if let Some(job) = &self.job {
            labels.push(("job_id", job.clone()));
        }
        labels
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn torchrun_ranks_are_grouped_by_their_rendezvous_unless_the_run_is_named() {
        let base = [
            ("RANK", "5"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "8"),
            ("MASTER_ADDR", "10.0.0.7"),
            ("MASTER_PORT", "29500"),
        ];
        let id = Identity::from_env(&env(&[&base[..], &[("TORCHELASTIC_RUN_ID", "none")]].concat()));
        assert_eq!((id.rank, id.local_rank, id.world_size), (Some(5), Some(1), Some(8)));
        assert_eq!(id.job.as_deref(), Some("10.0.0.7:29500"), "torchrun's default run id names nothing");
        let named = Identity::from_env(&env(&[&base[..], &[("TORCHELASTIC_RUN_ID", "llama-7b")]].concat()));
        assert_eq!(named.job.as_deref(), Some("torchelastic:llama-7b"));
        assert_eq!(named.labels(), [("rank", "5".to_owned()), ("job_id", "torchelastic:llama-7b".to_owned())]);
    }

    #[test]
    fn ascend_launchers_variables_give_the_same_identity() {
        let id = Identity::from_env(&env(&[
            ("RANK_ID", "3"),
            ("RANK_SIZE", "16"),
            ("DEVICE_ID", "3"),
            ("RANK_TABLE_FILE", "/job/hccl_16p.json"),
        ]));
        assert_eq!((id.rank, id.world_size, id.device.as_deref()), (Some(3), Some(16), Some("3")));
        assert_eq!(id.job.as_deref(), Some("rank_table:/job/hccl_16p.json"));
        let meta = id.meta();
        assert_eq!(
            meta.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            ["rank", "world_size", "rank_device", "job_id"]
        );
    }

    #[test]
    fn a_process_no_launcher_started_has_no_identity_and_bad_values_are_left_out() {
        assert_eq!(Identity::from_env(&env(&[("PATH", "/bin")])), Identity::default());
        assert!(Identity::default().meta().is_empty() && Identity::default().labels().is_empty());
        let id = Identity::from_env(&env(&[("RANK", "x"), ("RANK_ID", "2"), ("MASTER_ADDR", "h")]));
        assert_eq!(id.rank, None, "the first variable set decides, and RANK is not a number");
        assert_eq!(id.job, None, "an address without a port is no rendezvous");
    }

    #[test]
    fn the_identity_a_trace_recorded_reads_back_as_it_was() {
        let id = Identity::from_env(&env(&[
            ("RANK_ID", "3"),
            ("LOCAL_RANK", "1"),
            ("RANK_SIZE", "16"),
            ("DEVICE_ID", "3"),
            ("RANK_TABLE_FILE", "/job/hccl_16p.json"),
        ]));
        let meta = id.meta();
        let read = Identity::from_meta(|k| meta.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone()));
        assert_eq!(read, id);
        assert_eq!(Identity::from_meta(|k| (k == "rank").then(|| "two".to_owned())), Identity::default());
    }
}
