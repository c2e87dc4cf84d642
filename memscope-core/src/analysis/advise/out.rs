//! The advice as text, and as table `ms_advice`.

use super::*;
use crate::printable::printable;

pub fn text(advice: &Advice, report: &Report) -> String {
    let mut out = String::new();
    let m = &advice.measured;
    let _ = writeln!(out, "device {}: {}", advice.device, advice.db);
    let alloc_conf = advice.alloc_conf;
    let conf = advice.settings.get(alloc_conf).map_or_else(|| "unset".to_owned(), |v| format!("`{}`", printable(v)));
    let others: Vec<String> = advice
        .settings
        .iter()
        .filter(|(k, _)| *k != alloc_conf)
        .map(|(k, v)| format!("{}={}", printable(k), printable(v)))
        .collect();
    if advice.settings_known {
        let _ = writeln!(
            out,
            "  settings at the start: {alloc_conf} {conf}{}",
            if others.is_empty() { String::new() } else { format!("; {}", others.join(", ")) }
        );
    } else {
        let _ = writeln!(
            out,
            "  settings at the start: not in this capture (msMemScope's captures and CSV traces \
             record no environment); the advice takes {alloc_conf} as unset"
        );
    }
    if m.atb.executions > 0 {
        let _ = writeln!(
            out,
            "  ATB: {} execution(s) of {} operation(s); workspaces up to {} (scratch up to {}, intermediates up to {}), \
             the intermediates {:.0}% of the peak of {} {}",
            m.atb.executions,
            m.atb.op_count,
            b(m.atb.largest_total),
            b(m.atb.largest_workspace),
            b(m.atb.largest_intermediate),
            m.atb.intermediate_share() * 100.0,
            b(m.atb.peak_bytes),
            m.atb.peak_basis
        );
    }
    if m.peak_reserved == 0 {
        let _ = writeln!(out, "  no caching-pool memory in this trace (no PTA blocks or pool segments)");
        if advice.recommendations.is_empty() {
            let _ = writeln!(out, "  advice: nothing to change");
        }
        recommendations(&mut out, advice);
        return out;
    }
    let at = match (m.peak_ts_ns, report.start_ns) {
        (Some(ts), Some(start)) => format!(" at {}", relative(ts - start)),
        _ => String::new(),
    };
    let piece = m.largest_free_at_peak.map_or_else(|| "unknown (no segment rows)".to_owned(), b);
    let _ = writeln!(
        out,
        "  peak reserved {}{at}: allocated {}, unused {} ({:.0}%), {} of it in holes of segments in use; largest free piece {piece}",
        b(m.peak_reserved),
        b(m.allocated_at_peak),
        b(m.unused_at_peak),
        m.unused_at_peak as f64 * 100.0 / m.peak_reserved as f64,
        b(m.holes_at_peak)
    );
    let _ = writeln!(
        out,
        "  {} segment(s) taken, {} forced by fragmentation ({}); {} split(s); {} cache flush(es) at the ceiling; {} OOM(s) \
         ({} from fragmentation), {} recovered refusal(s)",
        m.growths,
        m.forced_growths,
        b(m.forced_growth_bytes),
        m.splits,
        m.flushes_at_ceiling,
        m.ooms,
        m.fragmentation_ooms,
        m.recovered_refusals
    );
    if advice.recommendations.is_empty() {
        let _ = writeln!(out, "  advice: nothing to change (no rule's evidence was found)");
    }
    recommendations(&mut out, advice);
    if let Some(sim) = &advice.simulation {
        replay(&mut out, sim);
    }
    out
}

/// The replay's agreement with the recorded run, then the recorded, replayed and asked-for
/// figures side by side.
fn replay(out: &mut String, sim: &simulate::Report) {
    if sim.baseline.is_none() {
        for note in &sim.notes {
            let _ = writeln!(out, "  allocator replay: {}", printable(note));
        }
        return;
    }
    let r = &sim.reproduction;
    let agreement = if r.recorded_segments == 0 {
        "the trace has no segment rows of the pool, so the replay cannot be checked against it".to_owned()
    } else if r.agrees {
        format!("replay matches the recorded run: {}/{} segments", r.matched_segments, r.recorded_segments)
    } else {
        format!(
            "replay does NOT match the recorded run: {}/{} segments agree, then {}; take the predictions as estimates",
            r.matched_segments,
            r.recorded_segments,
            r.first_difference.as_deref().unwrap_or("they part")
        )
    };
    let _ = writeln!(out, "  allocator replay (docs/simulate.md): {agreement}");
    let _ = writeln!(out, "    {:<40} {}", "as recorded", figures(&sim.recorded, None));
    let base = &sim.recorded;
    if let Some(b) = &sim.baseline {
        let name = if b.setting.is_empty() {
            "replayed as run (settings unset)".to_owned()
        } else {
            format!("replayed as run ({})", printable(&b.setting))
        };
        let _ = writeln!(out, "    {:<40} {}", name, figures(&b.figures, Some(base)));
    }
    for s in &sim.simulations {
        let _ = writeln!(out, "    {:<40} {}", printable(&s.setting), figures(&s.figures, Some(base)));
    }
    for note in &sim.notes {
        let _ = writeln!(out, "    note: {note}");
    }
}

/// One line of figures, with the change of peak reserved against `base`.
fn figures(f: &simulate::Figures, base: Option<&simulate::Figures>) -> String {
    let change = base
        .filter(|b| b.peak_reserved_bytes > 0)
        .map(|b| {
            format!(" ({})", crate::units::signed_bytes(f.peak_reserved_bytes as i64 - b.peak_reserved_bytes as i64))
        })
        .unwrap_or_default();
    let oom = match &f.first_oom {
        Some(o) => format!(
            "OUT OF MEMORY ({} time(s), first asking {} with {} reserved)",
            f.ooms,
            b(o.request_bytes),
            b(o.reserved_bytes)
        ),
        None if f.ooms > 0 => format!("{} OOM(s)", f.ooms),
        None => "no OOM".to_owned(),
    };
    let largest =
        f.largest_free_at_peak_bytes.map(|l| format!(", largest free piece at the peak {}", b(l))).unwrap_or_default();
    format!(
        "peak reserved {}{change}, peak allocated {}, {} segment(s), unused {} on average{largest}, {oom}",
        b(f.peak_reserved_bytes),
        b(f.peak_allocated_bytes),
        f.segments,
        b(f.unused_reserve_avg_bytes)
    )
}

fn recommendations(out: &mut String, advice: &Advice) {
    for (i, r) in advice.recommendations.iter().enumerate() {
        let what = match (r.variable, &r.value) {
            (Some(var), Some(value)) => format!("{var}={value}"),
            _ => r.setting.clone(),
        };
        // Both carry the target's own settings (and `why` ATB's op names).
        let _ = writeln!(out, "  {}. {}", i + 1, printable(&what));
        let _ = writeln!(out, "     why: {}", printable(&r.why));
        if !r.conflicts_with.is_empty() {
            let _ =
                writeln!(out, "     either this or {} (torch_npu refuses them together)", r.conflicts_with.join(", "));
        }
        if let Some(p) = &r.predicted {
            let base = advice.simulation.as_ref().map(|s| &s.recorded);
            let rank = r.predicted_rank.map(|k| format!("; rank {k} of the replayed settings")).unwrap_or_default();
            let _ = writeln!(out, "     would give (replayed): {}{rank}", figures(p, base));
        }
    }
}

pub const ADVICE_TABLE: &str = "ms_advice";
const CREATE_ADVICE: &str = "CREATE TABLE ms_advice (
    device TEXT NOT NULL, rank INTEGER NOT NULL, id TEXT NOT NULL, variable TEXT, setting TEXT NOT NULL,
    value TEXT, current TEXT, why TEXT NOT NULL, evidence TEXT NOT NULL, conflicts_with TEXT NOT NULL)";

/// The reserved bytes over time of the run as recorded and of each replay (docs/db-schema.md,
/// "ms_simulation"), which the report draws together.
pub const SIMULATION_TABLE: &str = "ms_simulation";
const CREATE_SIMULATION: &str = "CREATE TABLE ms_simulation (
    device TEXT NOT NULL, series TEXT NOT NULL, ts_ns INTEGER NOT NULL, reserved INTEGER NOT NULL)";

/// Each curve of the replay, named: `recorded`, `replayed as run`, then each setting asked for
/// and each recommendation's predicted value.
fn curves(advice: &Advice) -> Vec<(String, &[(i64, u64)])> {
    let Some(sim) = &advice.simulation else { return Vec::new() };
    let mut out: Vec<(String, &[(i64, u64)])> = vec![("recorded".to_owned(), &sim.recorded.curve[..])];
    if let Some(b) = &sim.baseline {
        out.push(("replayed as run".to_owned(), &b.figures.curve[..]));
    }
    out.extend(sim.simulations.iter().map(|s| (s.setting.clone(), &s.figures.curve[..])));
    for r in &advice.recommendations {
        if let (Some(p), Some(value)) = (&r.predicted, &r.value) {
            out.push((format!("advised: {value}"), &p.curve[..]));
        }
    }
    out
}

fn fill_simulation(tx: &rusqlite::Transaction<'_>, advice: &Advice) -> rusqlite::Result<usize> {
    let mut insert = tx.prepare("INSERT INTO ms_simulation VALUES (?1, ?2, ?3, ?4)")?;
    let mut rows = 0;
    for (series, points) in curves(advice) {
        for &(ts, reserved) in points {
            insert.execute(params![advice.device, series, ts, reserved as i64])?;
            rows += 1;
        }
    }
    Ok(rows)
}

/// Replaces `ms_advice`, `ms_fragmentation` and `ms_simulation` in one transaction; returns the
/// rows written.
pub fn store(db: &DumpDb, advice: &Advice, report: &Report, run_wall_ns: u64) -> Result<usize, AnalysisError> {
    let tables =
        [fragmentation::create_fragmentation(), (ADVICE_TABLE, CREATE_ADVICE), (SIMULATION_TABLE, CREATE_SIMULATION)];
    db.replace_tables(&tables, &[("advise_at", run_wall_ns.to_string())], |tx| {
        let mut rows = fragmentation::fill_samples(tx, &advice.device, &report.samples)?;
        rows += fill_simulation(tx, advice)?;
        let mut insert = tx.prepare("INSERT INTO ms_advice VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)")?;
        for (i, r) in advice.recommendations.iter().enumerate() {
            insert.execute(params![
                advice.device,
                i as i64 + 1,
                r.id,
                r.variable,
                r.setting,
                r.value,
                r.current,
                r.why,
                serde_json::to_string(&r.evidence).unwrap_or_default(),
                r.conflicts_with.join(",")
            ])?;
            rows += 1;
        }
        Ok(rows)
    })
}
