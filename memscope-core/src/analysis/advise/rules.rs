//! The advisor's rules, one function each: what it checks in the shared facts, and the
//! recommendation it makes with its evidence.

use super::*;

/// expandable_segments: holes between live blocks that no request could use.
pub(super) fn expandable_segments(f: &Facts<'_>) -> Option<Recommendation> {
    let (m, conf, report) = (&f.m, &f.conf, f.report);
    let holes_share = m.holes_at_peak as f64 / m.peak_reserved.max(1) as f64;
    let forced = m.forced_growths >= FORCED_MIN && holes_share >= HOLES_SHARE;
    if !conf.expandable() && (forced || m.fragmentation_ooms > 0) {
        let mut why = Vec::new();
        if forced {
            let g = report.forced.iter().max_by_key(|g| (g.holes_before, std::cmp::Reverse(g.ts_ns))).unwrap();
            why.push(format!(
                "the pool took {} new segment(s) ({}) while the free memory inside segments in use covered the \
                 request but no free piece did (e.g. {} requested with {} free in holes, the largest piece {}); at \
                 its peak of {} reserved, {} ({:.0}%) were such holes",
                m.forced_growths,
                b(m.forced_growth_bytes),
                b(g.request),
                b(g.holes_before),
                b(g.largest_before),
                b(m.peak_reserved),
                b(m.holes_at_peak),
                holes_share * 100.0
            ));
        }
        if m.fragmentation_ooms > 0 {
            why.push(format!(
                "{} allocation(s) failed with enough reserved but unused memory and no piece big enough",
                m.fragmentation_ooms
            ));
        }
        let dropped: Vec<&str> = ["max_split_size_mb", "garbage_collection_threshold"]
            .into_iter()
            .filter(|k| conf.get(k).is_some())
            .collect();
        if !dropped.is_empty() {
            why.push(format!(
                "{} removed: torch_npu refuses it together with expandable segments",
                dropped.join(" and ")
            ));
        }
        let evidence = ev(&[
            ("forced_growths", m.forced_growths.into()),
            ("forced_growth_bytes", m.forced_growth_bytes.into()),
            ("fragmentation_ooms", m.fragmentation_ooms.into()),
            ("peak_reserved", m.peak_reserved.into()),
            ("unused_at_peak", m.unused_at_peak.into()),
            ("holes_at_peak", m.holes_at_peak.into()),
        ]);
        return Some(f.env_rec(
            "expandable_segments",
            "expandable_segments",
            "True",
            &dropped,
            why.join("; "),
            evidence,
        ));
    }
    None
}

/// max_split_size_mb: big segments pinned by small blocks while a big request needed memory.
pub(super) fn max_split_size_mb(f: &Facts<'_>) -> Option<Recommendation> {
    let (conf, report) = (&f.conf, f.report);
    if !conf.expandable() && conf.get("max_split_size_mb").is_none() && !report.pinned_big.is_empty() {
        let smallest_segment = report.pinned_big.iter().map(|g| g.pinned_big_min).min().unwrap_or(0);
        let smallest_request = report.pinned_big.iter().map(|g| g.request).min().unwrap_or(0);
        let limit = split_limit_mib(smallest_segment.min(smallest_request) / MIB);
        let why = format!(
            "{} request(s) above 20 MiB (the smallest {}) needed a new segment while {} big segment(s) (the smallest \
             {}) were held by blocks under 10 MiB carved from them; blocks of {limit} MiB or more would then be kept \
             whole for big requests",
            report.pinned_big.len(),
            b(smallest_request),
            report.pinned_big.iter().map(|g| g.pinned_big).max().unwrap_or(0),
            b(smallest_segment)
        );
        let evidence = ev(&[
            ("pinned_big_growths", report.pinned_big.len().into()),
            ("smallest_pinned_segment", smallest_segment.into()),
            ("smallest_big_request", smallest_request.into()),
        ]);
        return Some(f.env_rec("max_split_size_mb", "max_split_size_mb", &limit.to_string(), &[], why, evidence));
    }
    None
}

/// garbage_collection_threshold: the cache emptied at a ceiling, again and again.
pub(super) fn garbage_collection_threshold(f: &Facts<'_>) -> Option<Recommendation> {
    let (m, conf, report) = (&f.m, &f.conf, f.report);
    let pressure = m.flushes_at_ceiling.max(m.recovered_refusals);
    if !conf.expandable() && conf.get("garbage_collection_threshold").is_none() && pressure >= FLUSH_MIN {
        let at_ceiling: Vec<&fragmentation::Flush> = report.flushes.iter().filter(|f| at_ceiling(f, m)).collect();
        let ceiling = at_ceiling.iter().map(|f| f.reserved_before).max().unwrap_or(m.peak_reserved).max(1);
        let working = m.max_allocated as f64 / ceiling as f64;
        // Above the live working set (else every allocation would collect), at most 0.9.
        let threshold = ((working + 0.2) * 10.0).ceil().clamp(6.0, 9.0) / 10.0;
        let value = format!("{threshold:.1}");
        let why = format!(
            "the pool reached its ceiling of about {} and freed {} of cached segments inside allocations {} time(s) \
             ({} runtime refusal(s) it recovered from); at most {} ({:.0}% of the ceiling) was allocated at once, so \
             releasing cached segments above {value} of the allowed memory keeps the working set; torch_npu applies \
             it against set_per_process_memory_fraction x device memory",
            b(ceiling),
            b(at_ceiling.iter().map(|f| f.freed).sum()),
            m.flushes_at_ceiling,
            m.recovered_refusals,
            b(m.max_allocated),
            working * 100.0
        );
        let evidence = ev(&[
            ("flushes_at_ceiling", m.flushes_at_ceiling.into()),
            ("recovered_refusals", m.recovered_refusals.into()),
            ("ceiling", ceiling.into()),
            ("max_allocated", m.max_allocated.into()),
        ]);
        return Some(f.env_rec(
            "garbage_collection_threshold",
            "garbage_collection_threshold",
            &value,
            &[],
            why,
            evidence,
        ));
    }
    None
}

/// set_per_process_memory_fraction: processes sharing the device.
pub(super) fn per_process_memory_fraction(f: &Facts<'_>) -> Option<Recommendation> {
    let m = &f.m;
    let sharing: Vec<&ProcessPeak> = m.processes.iter().filter(|p| p.peak_device.max(p.peak_reserved) > 0).collect();
    if sharing.len() >= 2 {
        let total: u64 = sharing.iter().map(|p| p.peak_device.max(p.peak_reserved)).sum();
        let shares: Vec<(i64, u64, f64)> = sharing
            .iter()
            .map(|p| {
                let peak = p.peak_device.max(p.peak_reserved);
                (p.pid, peak, (0.95 * peak as f64 / total as f64 * 100.0).floor() / 100.0)
            })
            .collect();
        let list: Vec<String> =
            shares.iter().map(|(pid, peak, f)| format!("pid {pid}: peak {}, fraction {f:.2}", b(*peak))).collect();
        let why = format!(
            "{} processes used this device ({}); without a fraction each process's allocator takes what it can and \
             the first to cache memory starves the others (the trace cannot see whether they set one)",
            shares.len(),
            list.join("; ")
        );
        let calls: Vec<String> =
            shares.iter().map(|(pid, _, f)| format!("set_per_process_memory_fraction({f:.2}) in pid {pid}")).collect();
        let evidence = ev(&[(
            "processes",
            serde_json::json!(shares
                .iter()
                .map(|(pid, peak, f)| serde_json::json!({"pid": pid, "peak": peak, "fraction": f}))
                .collect::<Vec<_>>()),
        )]);
        return Some(Recommendation {
            id: "per_process_memory_fraction",
            variable: None,
            setting: format!("{}.{}", f.backend.python_module(), calls.join(", ")),
            value: None,
            current: None,
            why,
            evidence,
            conflicts_with: Vec::new(),
            predicted: None,
            predicted_rank: None,
        });
    }
    None
}

/// MULTI_STREAM_MEMORY_REUSE: blocks waiting for another stream while the pool grew.
pub(super) fn multi_stream_memory_reuse(f: &Facts<'_>) -> Option<Recommendation> {
    let (settings, streams) = (f.settings, &f.m.streams);
    let reuse = settings.get(MULTI_STREAM).map(|v| v.trim().to_owned());
    let next = match reuse.as_deref() {
        Some("0") => Some(("1", "with reuse off nothing erases the marks once the collective was waited for")),
        None | Some("" | "1") => Some((
            "3",
            "they were freed before the collective that marked them was waited for, which reuse mode 1 (the default) does not cover",
        )),
        _ => None,
    };
    if let (true, Some((value, because))) = (streams.costly(), next) {
        let why = format!(
            "{} block(s) ({}) were freed while still marked as used by another stream (recordStream, as a \
             collective's tensors are); torch_npu keeps such blocks until that stream's work completes, and {because}. \
             Meanwhile the pool took {} of new segments, in {} step(s) (up to {} freed while marked in one step)",
            streams.deferred_blocks,
            b(streams.deferred_bytes),
            b(streams.grown_while_deferred),
            streams.steps_grown,
            b(streams.max_step_deferred_bytes)
        );
        return Some(Recommendation {
            id: MULTI_STREAM_REUSE_ID,
            variable: Some(MULTI_STREAM),
            setting: value.to_owned(),
            value: Some(value.to_owned()),
            current: reuse.clone(),
            why,
            evidence: ev_of(streams),
            conflicts_with: Vec::new(),
            predicted: None,
            predicted_rank: None,
        });
    }
    None
}

/// gc at epoch ends: garbage from earlier steps, held by reference cycles, live at the peak.
pub(super) fn gc_at_epoch_end(f: &Facts<'_>) -> Option<Recommendation> {
    let gc = &f.m.gc;
    if gc.significant() {
        let why = format!(
            "at the peak of {} live tensor memory, {} ({:.0}%, {} block(s)) were tensors from earlier steps that only \
             Python's garbage collector freed, later: they sat in reference cycles after the program dropped them. \
             In all the collector freed {} block(s) ({}) past the step they were born in, {:.1} step(s) later on \
             average; collecting at the end of each epoch (or every few steps when epochs are long) frees them \
             before the next peak",
            b(gc.peak_bytes),
            b(gc.held_at_peak),
            gc.held_at_peak as f64 * 100.0 / gc.peak_bytes.max(1) as f64,
            gc.held_blocks_at_peak,
            gc.late_blocks,
            b(gc.late_bytes),
            gc.mean_steps_late
        );
        return Some(Recommendation {
            id: GC_AT_EPOCH_END,
            variable: None,
            setting: "import gc; gc.collect() at the end of each epoch".to_owned(),
            value: None,
            current: None,
            why,
            evidence: ev_of(gc),
            conflicts_with: Vec::new(),
            predicted: None,
            predicted_rank: None,
        });
    }
    None
}

/// ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE: intermediates laid out by ATB's default are a large part
/// of the peak. Only unset or the default 1 are replaced: any other value is a choice.
pub(super) fn atb_workspace_alg_type(f: &Facts<'_>) -> Option<Recommendation> {
    let (settings, atb) = (f.settings, &f.m.atb);
    let atb_current = settings.get(ATB_ALG_TYPE).cloned();
    if atb.significant() && atb_current.as_deref().is_none_or(|v| v.trim() == "1") {
        return Some(atb_recommendation(atb, atb_current, settings.get(ATB_ALLOC_GLOBAL).map(String::as_str)));
    }
    None
}

pub(super) fn atb_recommendation(atb: &AtbWorkspace, current: Option<String>, global: Option<&str>) -> Recommendation {
    let top = atb.ops.first().cloned().unwrap_or_default();
    let mut why = format!(
        "ATB operations ran {} time(s) ({} operation(s)); the largest, {} (pid {}, {} execution(s)), asked its caller for \
         a workspace of {}: {} of kernel scratch and {} of intermediate tensors. Those intermediates are {:.0}% of the \
         peak of {} {}, and ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE, the algorithm that lays them out inside the workspace, was \
         {}. Another algorithm can place intermediates that are never live together in the same memory: {} is what \
         deployment scripts tuned for memory set (2 is also worth a try); re-run with it and compare the peak",
        atb.executions,
        atb.op_count,
        top.op,
        top.pid,
        top.executions,
        b(top.total()),
        b(top.workspace_size),
        b(top.intermediate_size),
        atb.intermediate_share() * 100.0,
        b(atb.peak_bytes),
        atb.peak_basis,
        match &current {
            Some(v) => format!("{} (ATB's default)", v.trim()),
            None => "unset (ATB's default, 1)".to_owned(),
        },
        ATB_ALG_ADVISED,
    );
    if global.is_none() {
        why.push_str(&format!(
            "; {ATB_ALLOC_GLOBAL} is unset: set it to 1 as well, which those scripts pair with it so that intermediate \
             memory is sized and laid out over the whole graph"
        ));
    }
    let ops: Vec<serde_json::Value> = atb
        .ops
        .iter()
        .map(|o| {
            serde_json::json!({"op": o.op, "pid": o.pid, "executions": o.executions,
                               "workspace_size": o.workspace_size, "intermediate_size": o.intermediate_size})
        })
        .collect();
    let evidence = ev(&[
        ("executions", atb.executions.into()),
        ("operations", atb.op_count.into()),
        ("largest_workspace", atb.largest_workspace.into()),
        ("largest_intermediate", atb.largest_intermediate.into()),
        ("largest_total", atb.largest_total.into()),
        ("peak_bytes", atb.peak_bytes.into()),
        ("peak_basis", atb.peak_basis.into()),
        ("intermediate_share", ((atb.intermediate_share() * 1000.0).round() / 1000.0).into()),
        ("workspace_share", ((atb.total_share() * 1000.0).round() / 1000.0).into()),
        ("ops", ops.into()),
    ]);
    Recommendation {
        id: ATB_ALG_RULE,
        variable: Some(ATB_ALG_TYPE),
        setting: format!("{ATB_ALG_TYPE}={ATB_ALG_ADVISED}"),
        value: Some(ATB_ALG_ADVISED.to_owned()),
        current,
        why,
        evidence,
        conflicts_with: Vec::new(),
        predicted: None,
        predicted_rank: None,
    }
}
