//! CPython's line tables: 3.11+'s location table (`co_linetable`, `Objects/locations.md` in
//! CPython), 3.10's `co_linetable` pairs and 3.9's `co_lnotab`. [`line_of`] gives the line
//! of a bytecode offset. Read by hand: no crate parses it, and it is a few dozen lines.
//!
//! Entries follow each other; each starts with a byte `1 cccc lll`: code `cccc`, and `lll + 1`
//! code units covered. The code says how the line changes: 15 no location, 14 long form (signed
//! varint line delta, then three varints), 13 no columns (signed varint delta), 10, 11 and 12 a
//! delta of 0, 1 and 2 (then two column bytes), 0-9 the same line (then one column byte).

fn varint(table: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    let mut shift = 0;
    loop {
        let byte = *table.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 63) << shift;
        shift += 6;
        if byte & 64 == 0 || shift > 60 {
            return Some(value);
        }
    }
}

fn svarint(table: &[u8], at: &mut usize) -> Option<i64> {
    let v = varint(table, at)?;
    Some(if v & 1 == 1 { -((v >> 1) as i64) } else { (v >> 1) as i64 })
}

/// The line of the instruction at code unit `unit` (bytes from the bytecode's start / 2), from
/// the code object's first line; `None` where the table gives it no line.
pub fn line_of(table: &[u8], firstlineno: i64, unit: u64) -> Option<i64> {
    let (mut at, mut line, mut covered) = (0usize, firstlineno, 0u64);
    while at < table.len() {
        let head = table[at];
        if head & 0x80 == 0 {
            return None;
        }
        at += 1;
        let code = (head >> 3) & 15;
        let length = u64::from(head & 7) + 1;
        let mut has_line = true;
        match code {
            15 => has_line = false,
            14 => {
                line += svarint(table, &mut at)?;
                for _ in 0..3 {
                    varint(table, &mut at)?;
                }
            }
            13 => line += svarint(table, &mut at)?,
            10..=12 => {
                line += i64::from(code) - 10;
                at += 2;
            }
            _ => at += 1,
        }
        if unit < covered + length {
            return has_line.then_some(line);
        }
        covered += length;
    }
    None
}

/// 3.10's `co_linetable`: (bytecode bytes, signed line delta) pairs from the first line, a
/// delta of -128 for bytes without a line. `addr` is in bytes.
pub fn line_of_310(table: &[u8], firstlineno: i64, addr: u64) -> Option<i64> {
    let (mut line, mut start) = (firstlineno, 0u64);
    for pair in table.chunks_exact(2) {
        let end = start + u64::from(pair[0]);
        let delta = pair[1] as i8;
        let here = (delta != -128).then(|| {
            line += i64::from(delta);
            line
        });
        if (start..end).contains(&addr) {
            return here;
        }
        start = end;
    }
    None
}

/// 3.9's `co_lnotab`: (bytecode bytes, signed line delta) increments; the line of `addr` (in
/// bytes) is the first line plus every delta whose address is at or before it.
pub fn line_of_lnotab(table: &[u8], firstlineno: i64, addr: u64) -> i64 {
    let (mut line, mut at) = (firstlineno, 0u64);
    for pair in table.chunks_exact(2) {
        at += u64::from(pair[0]);
        if at > addr {
            break;
        }
        line += i64::from(pair[1] as i8);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_follow_the_entries_of_each_form() {
        // From a first line of 10: 2 units on line 10 (short form, one column byte), 1 unit at
        // +1 (one-line form 11, two column bytes), 3 units at +5 (no-column form 13, svarint 10),
        // 1 unit with no location (15), 2 units at -2 (long form: svarint 5, then 3 varints).
        let table = [
            0x80 | 1,
            0x05,
            0x80 | (11 << 3),
            1,
            2,
            0x80 | (13 << 3) | 2,
            10,
            0x80 | (15 << 3),
            0x80 | (14 << 3) | 1,
            5,
            0,
            1,
            1,
        ];
        let lines: Vec<Option<i64>> = (0..10).map(|u| line_of(&table, 10, u)).collect();
        assert_eq!(lines, [Some(10), Some(10), Some(11), Some(16), Some(16), Some(16), None, Some(14), Some(14), None]);
    }

    /// Against CPython's own reading of its tables: every code object of a script, each code
    /// unit's line as `co_positions()` gives it, from every pyenv interpreter 3.11+ found.
    #[test]
    fn lines_are_the_interpreters_own_for_every_code_unit() {
        const SCRIPT: &str = "import json,sys\nsrc=open(sys.argv[1]).read()\n\
            out=[]\ndef walk(c):\n    out.append([c.co_firstlineno, list(c.co_linetable), [p[0] for p in c.co_positions()]])\n\
            \n    [walk(k) for k in c.co_consts if hasattr(k, 'co_code')]\nwalk(compile(src, sys.argv[1], 'exec'))\nprint(json.dumps(out))\n";
        let source = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/workloads/standin_pystacks.py");
        let mut checked = 0;
        for minor in [11, 12, 13] {
            let Some(python) = crate::stacks::python::tests::pyenv(minor) else { continue };
            let out = std::process::Command::new(&python).args(["-c", SCRIPT, source]).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let codes: Vec<(i64, Vec<u8>, Vec<Option<i64>>)> = serde_json::from_slice(&out.stdout).unwrap();
            for (first, table, lines) in &codes {
                for (unit, want) in lines.iter().enumerate() {
                    assert_eq!(
                        line_of(table, *first, unit as u64),
                        *want,
                        "3.{minor}, unit {unit} of a code object at {first}"
                    );
                }
            }
            checked += 1;
        }
        if checked == 0 {
            eprintln!("skipped: no pyenv CPython 3.11-3.13 (the location table) under ~/.pyenv/versions (xtask setup installs them)");
        }
    }

    /// 3.9 and 3.10 against their own `dis.findlinestarts` reading, every instruction of every
    /// code object of a script.
    #[test]
    fn old_tables_give_the_interpreters_own_lines() {
        const SCRIPT: &str = "import dis,json,sys\nsrc=open(sys.argv[1]).read()\nout=[]\n\
            def walk(c):\n    starts=dict(dis.findlinestarts(c))\n    lines=[]\n    cur=None\n\
            \n    for off in range(0,len(c.co_code),2):\n        cur=starts.get(off,cur)\n        lines.append(cur)\n\
            \n    t=c.co_linetable if sys.version_info>=(3,10) else c.co_lnotab\n\
            \n    out.append([c.co_firstlineno,list(t),lines])\n    [walk(k) for k in c.co_consts if hasattr(k,'co_code')]\n\
            walk(compile(src,sys.argv[1],'exec'))\nprint(json.dumps(out))\n";
        let source = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/workloads/standin_pystacks.py");
        for minor in [9, 10] {
            let Some(python) = crate::stacks::python::tests::pyenv(minor) else {
                eprintln!("skipped 3.{minor}: no pyenv CPython 3.{minor}");
                continue;
            };
            let out = std::process::Command::new(&python).args(["-c", SCRIPT, source]).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let codes: Vec<(i64, Vec<u8>, Vec<Option<i64>>)> = serde_json::from_slice(&out.stdout).unwrap();
            for (first, table, lines) in &codes {
                for (i, want) in lines.iter().enumerate() {
                    let Some(want) = want else { continue };
                    let addr = 2 * i as u64;
                    let got = if minor == 10 {
                        line_of_310(table, *first, addr)
                    } else {
                        Some(line_of_lnotab(table, *first, addr))
                    };
                    assert_eq!(got, Some(*want), "3.{minor}, byte {addr} of a code object at {first}");
                }
            }
        }
    }

    #[test]
    fn varints_take_six_bits_per_byte_with_the_seventh_to_go_on() {
        let mut at = 0;
        assert_eq!(varint(&[0x41, 0x02], &mut at), Some(1 | (2 << 6)));
        assert_eq!(at, 2);
        let mut at = 0;
        assert_eq!(svarint(&[3], &mut at), Some(-1));
    }
}
