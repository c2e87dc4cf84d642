//! The lines the helper and the tracer exchange. The tracer writes `read` (one line) whenever it
//! wants figures; the helper answers with one [`Message`] per line, as JSON: a [`Hello`] first
//! (or an error, then it exits), then a [`Reading`] per request. It exits when its input ends.

use serde::{Deserialize, Serialize};

/// The request line.
pub const READ: &str = "read";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    Dcmi,
    Nvml,
}

impl SourceKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Dcmi => "dcmi",
            Self::Nvml => "nvml",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "dcmi" => Some(Self::Dcmi),
            "nvml" => Some(Self::Nvml),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Message {
    Hello(Hello),
    Reading(Reading),
    /// The library could not be used at all; the helper exits after it.
    Error(String),
}

/// The library is loaded and answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub source: SourceKind,
    pub library: String,
    pub devices: Vec<u32>,
}

/// Every device's figures at one moment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Reading {
    /// Wall-clock (CLOCK_REALTIME) ns half way through the queries, as the trace's rows are
    /// stamped.
    pub ts_ns: u64,
    /// How long the queries took, in ns: what one reading costs.
    pub took_ns: u64,
    pub devices: Vec<DeviceReading>,
}

/// One device: its memory and what each process on it uses, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceReading {
    pub device: u32,
    pub total: Option<u64>,
    pub used: Option<u64>,
    pub processes: Vec<ProcessUse>,
    /// What failed of this device's queries, if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessUse {
    pub pid: u32,
    pub bytes: u64,
}

impl Message {
    pub fn line(&self) -> String {
        serde_json::to_string(self).expect("plain data serializes")
    }

    pub fn parse(line: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_survives_its_line() {
        let reading = Message::Reading(Reading {
            ts_ns: 1_764_000_000_000_000_000,
            took_ns: 1200,
            devices: vec![DeviceReading {
                device: 1,
                total: Some(64 << 30),
                used: None,
                processes: vec![ProcessUse { pid: 7, bytes: 3 << 20 }],
                error: Some("hbm: -8005".into()),
            }],
        });
        let line = reading.line();
        assert!(!line.contains('\n'));
        assert_eq!(Message::parse(&line).unwrap(), reading);
        assert_eq!(Message::parse(r#"{"error":"no"}"#).unwrap(), Message::Error("no".into()));
    }
}
