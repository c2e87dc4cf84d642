//! Sizes as users write them on command lines (`512KiB`, `2GiB`), for every verb that takes one,
//! and as every report and summary prints them (`1.5 MiB`).

/// `1048576`, `512KiB`, `1MiB`, `2GiB` (`K`/`M`/`G`/`T` too): bytes.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" | "KB" => 1 << 10,
        "M" | "MiB" | "MB" => 1 << 20,
        "G" | "GiB" | "GB" => 1 << 30,
        "T" | "TiB" | "TB" => 1 << 40,
        _ => return Err(format!("`{text}` is not a size (examples: 1048576, 512KiB, 1MiB, 2GiB)")),
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| format!("`{text}` is not a size (examples: 1048576, 512KiB, 1MiB, 2GiB)"))
}

/// `1.5 MiB`; bytes under 1 KiB as `512 B`: every count of bytes a person reads, signed (a
/// change) or not (a total).
pub fn human_bytes(bytes: impl Into<i128>) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    let bytes: i128 = bytes.into();
    if bytes.unsigned_abs() < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value.abs() >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A change in bytes: `+1.5 MiB`, `-512 B`, `0 B`.
pub fn signed_bytes(bytes: i64) -> String {
    if bytes > 0 {
        format!("+{}", human_bytes(bytes))
    } else {
        human_bytes(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_read_in_binary_units_with_one_decimal() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3u64 << 30), "3.0 GiB");
        assert_eq!(human_bytes(-1536), "-1.5 KiB");
        assert_eq!(signed_bytes(1536), "+1.5 KiB");
        assert_eq!(signed_bytes(0), "0 B");
    }
}
