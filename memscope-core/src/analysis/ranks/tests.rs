use super::*;
use crate::analysis::steps::testrows::noisy_run;

const MIB: i64 = 1 << 20;

fn member(job: &str, rank: u32, profile: Profile) -> Member {
    let identity = Identity { rank: Some(rank), world_size: Some(4), job: Some(job.to_owned()), ..Identity::default() };
    Member { label: format!("{job}/rank{rank}"), device: rank.to_string(), identity, profile }
}

fn point(ts: i64, owners: &[(&str, i64)]) -> Point {
    let mut p = Point { ts, ..Point::default() };
    for &(o, bytes) in owners {
        p.totals[Family::Pta as usize] += bytes;
        p.owners.insert((Family::Pta, o.to_owned()), bytes);
    }
    p
}

/// Step ends: (step, owners' bytes).
type Steps<'a> = &'a [(u64, &'a [(&'a str, i64)])];

/// A profile whose PTA peak is `peak` and whose step ends are `steps`.
fn synthetic(peak: &[(&str, i64)], steps: Steps<'_>) -> Profile {
    let mut profile = Profile::default();
    profile.peaks[Family::Pta as usize] = Some(point(5, peak));
    for (s, owners) in steps {
        profile.side.steps.insert(*s, point(*s as i64 * 10, owners));
    }
    profile
}

#[test]
fn the_leaking_rank_of_the_right_job_is_named_with_its_owner_from_the_dbs() {
    let mut members = Vec::new();
    for (job, leaky) in [("a", None), ("b", Some(2))] {
        for rank in 0..4 {
            let path = noisy_run(&format!("ranks-{job}-{rank}"), leaky == Some(rank));
            let db = DumpDb::open_read(&path).unwrap();
            members.push(member(job, rank, profile(&db, None).unwrap()));
        }
    }
    let c = compare_ranks(&members);
    assert_eq!(c.jobs.len(), 2);
    let (a, b) = (&c.jobs[0], &c.jobs[1]);
    assert_eq!((a.job.as_deref(), b.job.as_deref()), (Some("a"), Some("b")));
    assert!(a.outliers.is_empty(), "{:?}", a.outliers);
    assert_eq!(b.outliers.len(), 1, "{:?}", b.outliers);
    let o = &b.outliers[0];
    assert_eq!(o.rank, Some(2));
    // 2 MiB of kv cache kept per step from step 2 on: 11 steps compared (1..12), 10 of them grew.
    let leak = o.why.iter().find(|w| matches!(w, Why::Leak { .. })).expect("a leak reason");
    assert_eq!(
        leak,
        &Why::Leak {
            family: "PTA",
            owner: "PTA@kv_cache".into(),
            per_step: 22 * MIB / 11,
            total: 22 * MIB,
            others_per_step: 0,
            from: 1,
            to: 12
        }
    );
    let Some(Why::Peak { by, .. }) = o.why.iter().find(|w| matches!(w, Why::Peak { .. })) else { panic!("{o:?}") };
    assert_eq!(by.len(), 1, "the carried tensor's noise explains nothing: {by:?}");
    assert_eq!(by[0].owner, "PTA@kv_cache", "{by:?}");
    assert_eq!(by[0].bytes - by[0].others_median, 22 * MIB, "{by:?}");
    assert_eq!(b.steps, (1..=12).collect::<Vec<_>>());
    assert_eq!(b.compared, Some((1, 12)));
    let rank2 = &b.ranks[2];
    assert_eq!(rank2.grew[0], Held { family: "PTA", owner: "PTA@kv_cache".into(), bytes: 22 * MIB });
    let (end, start) = (rank2.at_steps[11].unwrap(), rank2.at_steps[0].unwrap());
    assert_eq!(rank2.growth_per_step, Some((end - start) / 11));
    assert_eq!(
        b.ranks[0].growth_per_step,
        Some((b.ranks[0].at_steps[11].unwrap() - b.ranks[0].at_steps[0].unwrap()) / 11)
    );
    assert!(b.missing.is_empty());
}

#[test]
fn a_stage_holding_more_activations_is_named_by_that_owner_and_small_differences_by_none() {
    let base = [("PTA@weight", 100 * MIB), ("PTA@activation", 40 * MIB)];
    let stage0 = [("PTA@weight", 100 * MIB), ("PTA@activation", 90 * MIB)];
    let near = [("PTA@weight", 100 * MIB), ("PTA@activation", 50 * MIB)];
    let members = vec![
        member("pp", 0, synthetic(&stage0, &[])),
        member("pp", 1, synthetic(&base, &[])),
        member("pp", 2, synthetic(&base, &[])),
        member("pp", 3, synthetic(&near, &[])),
    ];
    let job = &compare_ranks(&members).jobs[0];
    assert_eq!(job.outliers.len(), 1, "rank 3's 7% more is no outlier: {:?}", job.outliers);
    let o = &job.outliers[0];
    assert_eq!(o.rank, Some(0));
    assert_eq!(
        o.why,
        [Why::Peak {
            family: "PTA",
            peak: 190 * MIB,
            median: 140 * MIB,
            by: vec![Excess {
                family: "PTA",
                owner: "PTA@activation".into(),
                bytes: 90 * MIB,
                others_median: 40 * MIB
            }]
        }]
    );
    assert_eq!(job.ranks[0].owners[0].owner, "PTA@weight", "owners at the peak, largest first");
    assert_eq!(job.ranks[0].growth_per_step, None, "no steps: no growth");
}

#[test]
fn growth_that_is_not_steady_or_shared_by_the_others_is_no_leak() {
    let steady: Steps<'_> = &[(1, &[("PTA@kv", 0)]), (2, &[("PTA@kv", 2 * MIB)]), (3, &[("PTA@kv", 4 * MIB)])];
    let jumpy: Steps<'_> = &[(1, &[("PTA@kv", 0)]), (2, &[("PTA@kv", 6 * MIB)]), (3, &[("PTA@kv", 4 * MIB)])];
    let flat: Steps<'_> = &[(1, &[("PTA@kv", 0)]), (2, &[("PTA@kv", 0)]), (3, &[("PTA@kv", 0)])];
    let peak = [("PTA@kv", 4 * MIB)];
    let leaks = |profiles: Vec<Steps<'_>>| -> Vec<Option<u32>> {
        let members: Vec<Member> =
            profiles.into_iter().enumerate().map(|(r, s)| member("j", r as u32, synthetic(&peak, s))).collect();
        let job = compare_ranks(&members).jobs.remove(0);
        job.outliers.iter().filter(|o| o.why.iter().any(|w| matches!(w, Why::Leak { .. }))).map(|o| o.rank).collect()
    };
    assert_eq!(leaks(vec![flat, steady, flat, flat]), [Some(1)]);
    assert_eq!(leaks(vec![flat, jumpy, flat, flat]), [], "it gave memory back");
    assert_eq!(leaks(vec![steady, steady, steady, flat]), [], "the others grew as much");
    assert_eq!(leaks(vec![steady]), [], "one rank: nothing to compare with");
}

#[test]
fn of_two_ranks_the_higher_stands_out_and_missing_ranks_are_listed() {
    let members = vec![
        member("j", 0, synthetic(&[("PTA@w", 10 * MIB)], &[])),
        member("j", 3, synthetic(&[("PTA@w", 20 * MIB)], &[])),
    ];
    let job = &compare_ranks(&members).jobs[0];
    assert_eq!(job.outliers.iter().map(|o| o.rank).collect::<Vec<_>>(), [Some(3)]);
    assert_eq!(job.missing, [1, 2]);
    assert_eq!(job.family, Some("PTA"));
}

#[test]
fn the_median_of_an_even_count_is_the_lower_middle() {
    assert_eq!(median(vec![]), 0);
    assert_eq!(median(vec![5]), 5);
    assert_eq!(median(vec![9, 1]), 1);
    assert_eq!(median(vec![4, 1, 3, 2]), 2);
}
