//! A shortest edit script between two sequences: Myers' O(ND) difference algorithm ("An O(ND)
//! Difference Algorithm and Its Variations", 1986), in its linear-space form. `compare --level`
//! diffs two traces' operator or kernel name sequences with it, as msMemScope's compare does.
//!
//! Why the linear-space form: the greedy form keeps one diagonal array per edit to trace the path
//! back, O(D²) memory, and two training steps that differ by a few thousand kernels would need
//! gigabytes. Here each level finds the *middle snake* (the diagonal run halfway along an optimal
//! path, found by searching from both ends at once) and recurses on the two halves; the edit
//! count halves at each level, so the recursion is O(log D) deep and the memory O(N + M).
//! Common prefixes and suffixes are matched before any search: two runs of the same program
//! mostly agree, and then the search only sees the part that differs.
//!
//! Time is O((N + M) · D): fast for similar sequences, quadratic for unrelated ones.

/// One step of the edit script: indexes into A and B.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Edit {
    /// `a[a] == b[b]`, kept.
    Same { a: usize, b: usize },
    /// `a[.0]` is only in A (deleted).
    OnlyA(usize),
    /// `b[.0]` is only in B (inserted).
    OnlyB(usize),
}

/// A shortest edit script turning `a` into `b`, in sequence order: every index of `a` and of `b`
/// appears exactly once, and within a changed region deletions come before insertions.
pub fn diff<T: Eq>(a: &[T], b: &[T]) -> Vec<Edit> {
    let mut out = Vec::with_capacity(a.len().max(b.len()));
    let mut v = Diagonals::default();
    solve(a, 0, b, 0, &mut v, &mut out);
    deletions_first(&mut out);
    out
}

/// Orders each run of changes as its deletions then its insertions. The halves of the search
/// can interleave them (an empty middle snake splits a region anywhere), and a reader wants one
/// "was" block and one "is" block per changed region.
fn deletions_first(edits: &mut [Edit]) {
    for run in edits.split_mut(|e| matches!(e, Edit::Same { .. })) {
        run.sort_by_key(|e| match *e {
            Edit::OnlyA(i) => (0, i),
            Edit::OnlyB(j) => (1, j),
            Edit::Same { .. } => unreachable!("runs hold changes only"),
        });
    }
}

/// The furthest-reaching x per diagonal of the forward and the backward search, reused across
/// the recursion so each level allocates nothing.
#[derive(Default)]
struct Diagonals {
    forward: Vec<isize>,
    backward: Vec<isize>,
}

/// A diagonal run of equal elements from `(x0, y0)` to `(x1, y1)` that lies on a shortest path.
struct Snake {
    x0: usize,
    y0: usize,
    x1: usize,
    y1: usize,
}

/// Edits for `a` (starting at index `a0` of the whole A) against `b` (at `b0`).
fn solve<T: Eq>(a: &[T], a0: usize, b: &[T], b0: usize, v: &mut Diagonals, out: &mut Vec<Edit>) {
    let prefix = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    out.extend((0..prefix).map(|i| Edit::Same { a: a0 + i, b: b0 + i }));
    let (a, b, a0, b0) = (&a[prefix..], &b[prefix..], a0 + prefix, b0 + prefix);
    let suffix = a.iter().rev().zip(b.iter().rev()).take_while(|(x, y)| x == y).count();
    let (a, b) = (&a[..a.len() - suffix], &b[..b.len() - suffix]);
    if a.is_empty() {
        out.extend((0..b.len()).map(|j| Edit::OnlyB(b0 + j)));
    } else if b.is_empty() {
        out.extend((0..a.len()).map(|i| Edit::OnlyA(a0 + i)));
    } else {
        // Both non-empty and differing at both ends, so at least two edits: each half below
        // costs strictly fewer, which is what ends the recursion.
        let s = middle_snake(a, b, v);
        solve(&a[..s.x0], a0, &b[..s.y0], b0, v, out);
        out.extend((0..s.x1 - s.x0).map(|i| Edit::Same { a: a0 + s.x0 + i, b: b0 + s.y0 + i }));
        solve(&a[s.x1..], a0 + s.x1, &b[s.y1..], b0 + s.y1, v, out);
    }
    let (an, bn) = (a0 + a.len(), b0 + b.len());
    out.extend((0..suffix).map(|i| Edit::Same { a: an + i, b: bn + i }));
}

/// The middle snake of a shortest path from (0, 0) to (N, M), where x indexes `a`, y indexes `b`
/// and diagonal k holds the points with x − y = k.
///
/// The forward search extends, for d = 0, 1, ..., the furthest point each diagonal reaches with d
/// edits; the backward search does the same from (N, M) towards the origin on the diagonals
/// around Δ = N − M. The paths meet after ⌈D/2⌉ forward and ⌊D/2⌋ backward edits, and the last
/// snake of whichever search detected the overlap is on a shortest path (the edit cost to either
/// end only shrinks along a diagonal, so the two halves join at no extra cost).
///
/// Points off the grid (x > N or y > M forward, x < 0 or y < 0 backward) are kept as the
/// searches' values, but never count as an overlap: no path through them reaches the far corner.
fn middle_snake<T: Eq>(a: &[T], b: &[T], v: &mut Diagonals) -> Snake {
    let (n, m) = (a.len() as isize, b.len() as isize);
    let delta = n - m;
    let odd = delta % 2 != 0;
    let max = (n + m + 1) / 2;
    // Forward diagonal k lives at k + off; backward diagonal Δ + c at c + off.
    let off = max + 1;
    let width = (2 * max + 3) as usize;
    for vec in [&mut v.forward, &mut v.backward] {
        vec.clear();
        vec.resize(width, 0);
    }
    let (vf, vb) = (&mut v.forward, &mut v.backward);
    vf[(1 + off) as usize] = 0;
    vb[(1 + off) as usize] = n + 1;
    let on_grid = |x: isize, y: isize| (0..=n).contains(&x) && (0..=m).contains(&y);
    for d in 0..=max {
        for k in (-d..=d).step_by(2) {
            let i = (k + off) as usize;
            let mut x = if k == -d || (k != d && vf[i - 1] < vf[i + 1]) { vf[i + 1] } else { vf[i - 1] + 1 };
            let mut y = x - k;
            let (x0, y0) = (x, y);
            while x < n && y < m && a[x as usize] == b[y as usize] {
                x += 1;
                y += 1;
            }
            vf[i] = x;
            let c = k - delta;
            if odd && (-(d - 1)..=d - 1).contains(&c) && on_grid(x, y) {
                let xb = vb[(c + off) as usize];
                if on_grid(xb, xb - k) && xb <= x {
                    return snake(x0, y0, x, y);
                }
            }
        }
        for c in (-d..=d).step_by(2) {
            let i = (c + off) as usize;
            let k = c + delta;
            let mut x = if c == -d || (c != d && vb[i + 1] - 1 < vb[i - 1]) { vb[i + 1] - 1 } else { vb[i - 1] };
            let mut y = x - k;
            let (xs, ys) = (x, y);
            while x > 0 && y > 0 && a[(x - 1) as usize] == b[(y - 1) as usize] {
                x -= 1;
                y -= 1;
            }
            vb[i] = x;
            if !odd && (-d..=d).contains(&k) && on_grid(x, y) {
                let xf = vf[(k + off) as usize];
                if on_grid(xf, xf - k) && x <= xf {
                    return snake(x, y, xs, ys);
                }
            }
        }
    }
    unreachable!("the searches meet within (N + M + 1) / 2 edits each")
}

fn snake(x0: isize, y0: isize, x1: isize, y1: isize) -> Snake {
    Snake { x0: x0 as usize, y0: y0 as usize, x1: x1 as usize, y1: y1 as usize }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The length of a longest common subsequence, by the textbook O(NM) table.
    fn lcs_len<T: Eq>(a: &[T], b: &[T]) -> usize {
        let mut row = vec![0usize; b.len() + 1];
        for x in a {
            let mut diag = 0;
            for (j, y) in b.iter().enumerate() {
                let up = row[j + 1];
                row[j + 1] = if x == y { diag + 1 } else { up.max(row[j]) };
                diag = up;
            }
        }
        row[b.len()]
    }

    /// Checks that `edits` is a valid script from `a` to `b` (every index once, in order, `Same`
    /// only on equal elements, deletions before insertions) and returns its number of matches.
    fn check<T: Eq + std::fmt::Debug>(a: &[T], b: &[T], edits: &[Edit]) -> usize {
        let (mut i, mut j, mut same, mut inserting) = (0, 0, 0, false);
        for e in edits {
            match *e {
                Edit::Same { a: x, b: y } => {
                    assert_eq!((x, y), (i, j), "{edits:?}");
                    assert_eq!(a[x], b[y]);
                    (i, j, same, inserting) = (i + 1, j + 1, same + 1, false);
                }
                Edit::OnlyA(x) => {
                    assert_eq!(x, i, "{edits:?}");
                    assert!(!inserting, "a deletion after an insertion: {edits:?}");
                    i += 1;
                }
                Edit::OnlyB(y) => {
                    assert_eq!(y, j, "{edits:?}");
                    (j, inserting) = (j + 1, true);
                }
            }
        }
        assert_eq!((i, j), (a.len(), b.len()), "every element once: {edits:?}");
        same
    }

    fn shortest<T: Eq + std::fmt::Debug>(a: &[T], b: &[T]) {
        let edits = diff(a, b);
        assert_eq!(check(a, b, &edits), lcs_len(a, b), "not minimal: {a:?} -> {b:?}: {edits:?}");
    }

    #[test]
    fn empty_sides() {
        assert!(diff::<u8>(&[], &[]).is_empty());
        assert_eq!(diff(&[], &[7, 8]), [Edit::OnlyB(0), Edit::OnlyB(1)]);
        assert_eq!(diff(&[7, 8], &[]), [Edit::OnlyA(0), Edit::OnlyA(1)]);
    }

    #[test]
    fn identical_sequences_are_all_same() {
        let a = ["aten.mm.default", "aten.add.Tensor", "aten.mm.default"];
        let want: Vec<Edit> = (0..3).map(|i| Edit::Same { a: i, b: i }).collect();
        assert_eq!(diff(&a, &a), want);
    }

    #[test]
    fn all_different_is_every_deletion_then_every_insertion() {
        assert_eq!(
            diff(&[1, 2], &[3, 4, 5]),
            [Edit::OnlyA(0), Edit::OnlyA(1), Edit::OnlyB(0), Edit::OnlyB(1), Edit::OnlyB(2)]
        );
    }

    #[test]
    fn insertions_and_deletions_are_placed_where_they_are() {
        let a = ["mm", "add", "relu", "mm", "sum"];
        let b = ["mm", "add", "cat", "relu", "mm"];
        assert_eq!(
            diff(&a, &b),
            [
                Edit::Same { a: 0, b: 0 },
                Edit::Same { a: 1, b: 1 },
                Edit::OnlyB(2),
                Edit::Same { a: 2, b: 3 },
                Edit::Same { a: 3, b: 4 },
                Edit::OnlyA(4),
            ]
        );
        // A change in the middle, away from any common prefix or suffix: the middle snake's case.
        shortest(b"xabcabba".as_slice(), b"cbabacy".as_slice());
    }

    #[test]
    fn every_small_pair_over_three_letters_is_minimal() {
        // Exhaustive up to length 5: 364² pairs, every off-grid and parity case of the searches.
        let mut all: Vec<Vec<u8>> = vec![vec![]];
        let mut last = all.clone();
        for _ in 0..5 {
            last = last.iter().flat_map(|s| (0..3).map(move |c| [s.as_slice(), &[c]].concat())).collect();
            all.extend(last.iter().cloned());
        }
        for a in &all {
            for b in &all {
                shortest(a, b);
            }
        }
    }

    proptest! {
        #[test]
        fn matches_as_many_as_the_longest_common_subsequence(
            a in proptest::collection::vec(0u8..4, 0..60),
            b in proptest::collection::vec(0u8..4, 0..60),
        ) {
            shortest(&a, &b);
        }

        #[test]
        fn a_few_edits_of_a_long_sequence_are_found_as_such(
            a in proptest::collection::vec(0u16..50, 200..400),
            cuts in proptest::collection::vec((0usize..400, 0u16..50, any::<bool>()), 1..6),
        ) {
            let mut b = a.clone();
            for (at, value, insert) in cuts {
                let at = at % (b.len() + 1);
                if insert || at == b.len() { b.insert(at, value) } else { b.remove(at); }
            }
            shortest(&a, &b);
        }
    }
}
