//! `memscope-bpf compare` over a distributed job's traces, one per rank (`--ranks`, or more than
//! two traces, or folders holding several traces of one device): which traces those are, each
//! one's rank and job from its `ms_meta`, and the text of [`ranks::compare_ranks`]'s judgement.
//! The judging is memscope-core's; this picks the DBs and prints.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{bail, Context as _};
use memscope_core::analysis::db::DbFile;
use memscope_core::analysis::ranks::{self, Comparison, JobView, Member, Why};
use memscope_core::printable::printable;
use memscope_core::units::{human_bytes, signed_bytes as signed};

use super::compare::Args;
use super::inputs;
use crate::terminal::say::say;

/// The traces to compare as ranks, with their devices; `None` when the arguments ask for A
/// against B.
pub fn wanted(args: &Args) -> anyhow::Result<Option<Vec<(DbFile, String)>>> {
    let given: Vec<PathBuf> = std::iter::once(&args.a).chain(&args.b).chain(&args.more).cloned().collect();
    let explicit = args.ranks || given.len() > 2;
    let want = args.device.as_deref().map(inputs::normalise_device);
    let Some(files) = inputs::rank_files(&given, &["A", "B"], want, explicit)? else {
        if args.b.is_none() {
            bail!("{} is one trace: give a second (B) to compare with it, or folders holding a job's traces, one per rank", args.a.display());
        }
        return Ok(None);
    };
    if let Some(level) = args.level {
        bail!(
            "--level {} compares two traces; these are {} traces of a job's ranks: give two trace folders or DB files with --level",
            clap::ValueEnum::to_possible_value(&level).map_or(String::new(), |v| v.get_name().to_owned()),
            files.len()
        );
    }
    Ok(Some(files))
}

/// One trace as a rank: its identity and profile.
fn member(file: &DbFile, device: &str, marker: Option<&str>) -> anyhow::Result<Member> {
    let (db, _) = inputs::open(file, "compare", inputs::Store::Never)?;
    let identity = ranks::identity_of(&db)?;
    let profile = ranks::profile(&db, marker)?;
    Ok(Member { label: file.shown().display().to_string(), device: device.to_owned(), identity, profile })
}

pub fn run(args: &Args, files: Vec<(DbFile, String)>) -> anyhow::Result<()> {
    say!("memscope-bpf: comparing {} traces as ranks", files.len());
    let members = files
        .iter()
        .map(|(f, d)| member(f, d, args.step_marker.as_deref()).with_context(|| f.shown().display().to_string()))
        .collect::<anyhow::Result<Vec<Member>>>()?;
    let comparison = ranks::compare_ranks(&members);
    let out = if args.json {
        serde_json::to_string_pretty(&comparison).context("cannot format the JSON report")? + "\n"
    } else {
        text(&comparison)
    };
    super::compare::write_stdout(&out)
}

fn rank_name(rank: Option<u32>, device: &str, label: &str) -> String {
    match rank {
        Some(r) => format!("rank {r}"),
        None => format!("{} (device {device})", short(label)),
    }
}

/// A trace's path without the parts every trace folder has.
fn short(label: &str) -> String {
    let p = PathBuf::from(label);
    let run = p.ancestors().find(|a| {
        a.file_name().is_some_and(|n| {
            !n.to_string_lossy().starts_with("device_") && n != "dump" && !n.to_string_lossy().ends_with(".db")
        })
    });
    run.map_or(label.to_owned(), |r| r.display().to_string())
}

pub fn text(c: &Comparison) -> String {
    let mut out = String::new();
    for job in &c.jobs {
        job_text(&mut out, job);
    }
    out
}

fn job_text(out: &mut String, job: &JobView) {
    let name = job.job.as_deref().map_or("traces without a job id".to_owned(), |j| format!("job {}", printable(j)));
    let of = job.world_size.map_or(String::new(), |w| format!(" of {w}"));
    let family = job.family.unwrap_or("no memory");
    let steps = match job.compared {
        Some((a, b)) if a < b => format!("steps {a}..{b} compared"),
        _ => "no step every rank ended twice: no growth compared".to_owned(),
    };
    let _ = writeln!(out, "{name}: {} ranks{of}; {family} live bytes; {steps}", job.ranks.len());
    if !job.missing.is_empty() {
        let missing: Vec<String> = job.missing.iter().map(u32::to_string).collect();
        let _ = writeln!(out, "  ranks not given: {}", missing.join(", "));
    }
    let _ =
        writeln!(out, "  {:<10} {:>6}  {:>11}  {:>12}  owners at the peak", "rank", "device", "peak", "growth/step");
    for r in &job.ranks {
        let owners: Vec<String> =
            r.owners.iter().take(3).map(|h| format!("{} {}", printable(&h.owner), human_bytes(h.bytes))).collect();
        let rank = r.rank.map_or("-".to_owned(), |x| x.to_string());
        let growth = r.growth_per_step.map_or("-".to_owned(), signed);
        let _ = writeln!(
            out,
            "  {rank:<10} {:>6}  {:>11}  {growth:>12}  {}",
            r.device,
            human_bytes(r.peak),
            owners.join(", ")
        );
    }
    if job.outliers.is_empty() {
        let _ = writeln!(out, "  no rank stands out");
    }
    for o in &job.outliers {
        let r = &job.ranks[o.index];
        let _ = writeln!(out, "  {} stands out ({}):", rank_name(o.rank, &r.device, &o.label), short(&o.label));
        for why in &o.why {
            let _ = writeln!(out, "    {}", reason(why));
        }
    }
    grid_text(out, job);
    let _ = writeln!(out, "  traces:");
    for r in &job.ranks {
        let _ = writeln!(out, "    {}: {}", rank_name(r.rank, &r.device, &r.label), r.label);
    }
}

fn reason(why: &Why) -> String {
    match why {
        Why::Peak { family, peak, median, by } => {
            let owners: Vec<String> = by
                .iter()
                .take(3)
                .map(|e| {
                    format!(
                        "{} {} (others {})",
                        printable(&e.owner),
                        human_bytes(e.bytes),
                        human_bytes(e.others_median)
                    )
                })
                .collect();
            format!(
                "{family} peak {} against the other ranks' median {} ({}), by {}",
                human_bytes(*peak),
                human_bytes(*median),
                signed(peak - median),
                owners.join(", ")
            )
        }
        Why::Leak { owner, per_step, total, others_per_step, from, to, .. } => format!(
            "{} grew {} per step over steps {from}..{to} ({}) and never gave it back; the other ranks' {} per step",
            printable(owner),
            signed(*per_step),
            signed(*total),
            signed(*others_per_step)
        ),
    }
}

/// Steps down, ranks across: the family's live bytes at each step's end.
fn grid_text(out: &mut String, job: &JobView) {
    if job.steps.is_empty() {
        return;
    }
    let _ = writeln!(out, "  {} live bytes at each step's end (rank × step):", job.family.unwrap_or(""));
    let mut head = format!("    {:>6}", "step");
    for r in &job.ranks {
        let _ = write!(head, "  {:>10}", r.rank.map_or(format!("dev {}", r.device), |x| format!("rank {x}")));
    }
    let _ = writeln!(out, "{head}");
    for (i, step) in job.steps.iter().enumerate() {
        let mut line = format!("    {step:>6}");
        for r in &job.ranks {
            let _ = write!(line, "  {:>10}", r.at_steps[i].map_or("-".to_owned(), human_bytes));
        }
        let _ = writeln!(out, "{line}");
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use clap::Parser as _;
    use memscope_core::analysis::steps::testrows::noisy_run;
    use memscope_core::analysis::testdb::dir;

    use super::*;

    /// Job `job`'s rank `rank` on `node`: a daemon's run folder holding its device's DB, with the
    /// identity its launcher gave it in `ms_meta`.
    fn rank_folder(node: &Path, job: &str, rank: u32, leak: bool) {
        let db = noisy_run(&format!("cli-ranks-src-{job}-{rank}"), leak);
        let device = rank % 2;
        let run = node.join(format!("memscope_{}{rank}_20260101000000_ascend", &job[7..8]));
        let dump = run.join(format!("device_{device}/dump"));
        std::fs::create_dir_all(&dump).unwrap();
        let to = dump.join("memscope_dump_20260101000000.db");
        std::fs::copy(&db, &to).unwrap();
        let conn = rusqlite::Connection::open(&to).unwrap();
        for (k, v) in [("rank", rank.to_string()), ("world_size", "4".into()), ("job_id", job.into())] {
            conn.execute("INSERT INTO ms_meta (key, value) VALUES (?1, ?2)", [k, v.as_str()]).unwrap();
        }
    }

    fn args(argv: &[&str]) -> Args {
        let mut full = vec!["memscope-bpf", "compare"];
        full.extend_from_slice(argv);
        match crate::cli::Cli::try_parse_from(full).unwrap().command {
            crate::cli::Command::Compare(args) => args,
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn two_nodes_folders_are_compared_as_ranks_and_the_leaking_rank_of_its_job_is_named() {
        let root = dir("cli-ranks");
        let (node1, node2) = (root.join("node1"), root.join("node2"));
        for (job, leaky) in [("10.0.0.1:29500", None), ("10.0.0.9:29500", Some(3))] {
            for rank in 0..4 {
                rank_folder(if rank < 2 { &node1 } else { &node2 }, job, rank, leaky == Some(rank));
            }
        }
        let (n1, n2) = (node1.to_str().unwrap(), node2.to_str().unwrap());
        let a = args(&[n1, n2]);
        let files = wanted(&a).unwrap().expect("folders holding several traces of one device are ranks");
        assert_eq!(files.len(), 8);
        let members: Vec<Member> = files.iter().map(|(f, d)| member(f, d, None).unwrap()).collect();
        let c = ranks::compare_ranks(&members);
        let out = text(&c);
        let (first, second) = out.split_once("job 10.0.0.9:29500").expect(&out);
        assert!(first.starts_with("job 10.0.0.1:29500: 4 ranks of 4; PTA live bytes; steps 1..12 compared"), "{out}");
        assert!(first.contains("no rank stands out"), "{out}");
        assert!(second.contains("rank 3 stands out"), "{out}");
        assert!(second.contains("PTA@kv_cache grew +2.0 MiB per step over steps 1..12 (+22.0 MiB)"), "{out}");
        assert_eq!(second.matches("stands out").count(), 1, "{out}");
        let json = serde_json::to_value(&c).unwrap();
        assert_eq!(json["jobs"][1]["outliers"][0]["rank"], 3);
        assert_eq!(json["jobs"][1]["outliers"][0]["why"][1]["kind"], "leak", "{json:#}");
        assert_eq!(json["jobs"][1]["ranks"][3]["at_steps"].as_array().unwrap().len(), 12);

        let err = wanted(&args(&[n1, n2, "--level", "op"])).unwrap_err();
        assert!(format!("{err:#}").contains("--level op compares two traces"), "{err:#}");
        let one = |job: &str, rank: u32| {
            let folder = if rank < 2 { &node1 } else { &node2 };
            folder.join(format!("memscope_{}{rank}_20260101000000_ascend", &job[7..8])).display().to_string()
        };
        let (x, y) = (one("10.0.0.1:29500", 0), one("10.0.0.1:29500", 2));
        assert!(wanted(&args(&[&x, &y])).unwrap().is_none(), "two traces: A against B");
        assert_eq!(wanted(&args(&[&x, &y, "--ranks"])).unwrap().map(|f| f.len()), Some(2));
        assert_eq!(wanted(&args(&[n2])).unwrap().map(|f| f.len()), Some(4), "one folder of four traces");
        let err = wanted(&args(&[&x])).unwrap_err();
        assert!(format!("{err:#}").contains("is one trace: give a second (B)"), "{err:#}");
    }
}
