//! What the machine is, for reports: the CPU's name.

/// The CPU's model name from `/proc/cpuinfo` (its first `model name` line), if
/// there is one (not on macOS, nor on many ARM kernels).
pub fn cpu_name() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    cpu_name_in(&info)
}

fn cpu_name_in(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_model_name_line() {
        let info = "processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n\
                    processor\t: 1\nmodel name\t: other\n";
        assert_eq!(
            cpu_name_in(info).as_deref(),
            Some("AMD EPYC 9R14 96-Core Processor")
        );
        assert_eq!(cpu_name_in("processor\t: 0\n"), None);
    }
}
