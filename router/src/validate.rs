//! Checksums and plausibility checks used by the recognizers.
//!
//! Every function takes the matched text as written (separators included) and
//! ignores spaces and dashes itself, so callers never need to normalise.

/// The characters of `s` that are ASCII alphanumerics, upper-cased.
fn compact(s: &str) -> Vec<u8> {
    s.bytes()
        .filter(u8::is_ascii_alphanumeric)
        .map(|b| b.to_ascii_uppercase())
        .collect()
}

/// The ASCII digits of `s`, as numbers 0..=9.
fn digits(s: &str) -> Vec<u8> {
    s.bytes()
        .filter(u8::is_ascii_digit)
        .map(|b| b - b'0')
        .collect()
}

/// Luhn (mod 10) check over the digits of `s`; false when there are fewer than two.
pub fn luhn(s: &str) -> bool {
    let d = digits(s);
    if d.len() < 2 {
        return false;
    }
    let sum: u32 = d
        .iter()
        .rev()
        .enumerate()
        .map(|(i, &x)| {
            let x = u32::from(x);
            if i % 2 == 1 {
                let y = x * 2;
                if y > 9 {
                    y - 9
                } else {
                    y
                }
            } else {
                x
            }
        })
        .sum();
    sum.is_multiple_of(10)
}

/// Whether the digits of `s` have the length and issuer prefix (IIN) of a real
/// payment card network: Visa, Mastercard, Maestro, Amex, Discover, UnionPay,
/// JCB, Diners.
pub fn plausible_card_iin(s: &str) -> bool {
    let d = digits(s);
    let n = d.len();
    if !(13..=19).contains(&n) {
        return false;
    }
    let p = |k: usize| -> u32 { d.iter().take(k).fold(0u32, |a, &x| a * 10 + u32::from(x)) };
    match d[0] {
        4 => matches!(n, 13 | 16 | 19), // Visa
        5 => {
            ((51..=55).contains(&p(2)) && n == 16)                  // Mastercard
                || (p(2) == 50 || (56..=58).contains(&p(2))) // Maestro
        }
        2 => (2221..=2720).contains(&p(4)) && n == 16, // Mastercard 2-series
        3 => {
            let p2 = p(2);
            ((p2 == 34 || p2 == 37) && n == 15)                                 // Amex
                || ((3528..=3589).contains(&p(4)) && (16..=19).contains(&n))    // JCB
                || ((p2 == 36 || p2 == 38 || (300..=305).contains(&p(3))) && (14..=16).contains(&n))
            // Diners
        }
        6 => {
            ((p(4) == 6011 || p(2) == 65 || (644..=649).contains(&p(3)) || p(2) == 62)
                && (16..=19).contains(&n))
                || p(2) == 67 // Maestro
        }
        _ => false,
    }
}

/// IBAN length per country for the countries we validate (ISO 13616 registry).
pub(crate) fn iban_length(country: &[u8]) -> Option<usize> {
    Some(match country {
        b"AD" => 24,
        b"AE" => 23,
        b"AT" => 20,
        b"BE" => 16,
        b"BG" => 22,
        b"BH" => 22,
        b"CH" => 21,
        b"CY" => 28,
        b"CZ" => 24,
        b"DE" => 22,
        b"DK" => 18,
        b"EE" => 20,
        b"ES" => 24,
        b"FI" => 18,
        b"FR" => 27,
        b"GB" => 22,
        b"GR" => 27,
        b"HR" => 21,
        b"HU" => 28,
        b"IE" => 22,
        b"IL" => 23,
        b"IS" => 26,
        b"IT" => 27,
        b"LI" => 21,
        b"LT" => 20,
        b"LU" => 20,
        b"LV" => 21,
        b"MC" => 27,
        b"MT" => 31,
        b"NL" => 18,
        b"NO" => 15,
        b"PL" => 28,
        b"PT" => 25,
        b"RO" => 24,
        b"SA" => 24,
        b"SE" => 24,
        b"SI" => 19,
        b"SK" => 24,
        b"SM" => 27,
        b"TR" => 26,
        b"UA" => 29,
        _ => return None,
    })
}

/// ISO 13616 IBAN check: known country, the country's length, mod-97 == 1.
pub fn iban_mod97(s: &str) -> bool {
    let c = compact(s);
    if c.len() < 15 || c.len() > 34 {
        return false;
    }
    if iban_length(&c[..2]) != Some(c.len()) {
        return false;
    }
    mod97_rearranged(&c)
}

/// Generic mod-97 (ISO 7064 MOD 97-10) over the compacted text, with the first
/// four characters moved to the end (the IBAN arrangement). Usable by custom
/// recognizers for any IBAN-like format.
pub fn mod97(s: &str) -> bool {
    let c = compact(s);
    c.len() >= 5 && mod97_rearranged(&c)
}

fn mod97_rearranged(c: &[u8]) -> bool {
    let mut rem: u32 = 0;
    for &b in c[4..].iter().chain(c[..4].iter()) {
        let v = match b {
            b'0'..=b'9' => u32::from(b - b'0'),
            b'A'..=b'Z' => u32::from(b - b'A') + 10,
            _ => return false,
        };
        rem = if v >= 10 {
            (rem * 100 + v) % 97
        } else {
            (rem * 10 + v) % 97
        };
    }
    rem == 1
}

/// First two digits of a PRC resident ID: the province-level region code.
fn cn_region_ok(d: &[u8]) -> bool {
    let r = d[0] * 10 + d[1];
    matches!(r, 11..=15 | 21..=23 | 31..=37 | 41..=46 | 50..=54 | 61..=65 | 71 | 81 | 82 | 91)
}

fn valid_date(y: u32, m: u32, d: u32) -> bool {
    if !(1..=12).contains(&m) || d == 0 {
        return false;
    }
    let leap = (y.is_multiple_of(4) && !y.is_multiple_of(100)) || y.is_multiple_of(400);
    let days = match m {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    d <= days
}

fn num(d: &[u8]) -> u32 {
    d.iter().fold(0, |a, &x| a * 10 + u32::from(x))
}

/// 18-digit PRC resident identity number: region prefix, birth date
/// (1900..=2099), and the ISO 7064 MOD 11-2 check character (`0-9` or `X`).
pub fn cn_resident_id(s: &str) -> bool {
    let c = compact(s);
    if c.len() != 18 || !c[..17].iter().all(u8::is_ascii_digit) {
        return false;
    }
    let d: Vec<u8> = c[..17].iter().map(|b| b - b'0').collect();
    if !cn_region_ok(&d) {
        return false;
    }
    let (y, m, day) = (num(&d[6..10]), num(&d[10..12]), num(&d[12..14]));
    if !(1900..=2099).contains(&y) || !valid_date(y, m, day) {
        return false;
    }
    const W: [u32; 17] = [7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2];
    const CHECK: &[u8; 11] = b"10X98765432";
    let sum: u32 = d.iter().zip(W).map(|(&x, w)| u32::from(x) * w).sum();
    CHECK[(sum % 11) as usize] == c[17]
}

/// 15-digit legacy PRC resident ID (issued before 1999): region prefix and a
/// valid 19YYMMDD birth date. It has no check digit.
pub fn cn_resident_id_legacy(s: &str) -> bool {
    let d = digits(s);
    if d.len() != 15 || !cn_region_ok(&d) {
        return false;
    }
    valid_date(1900 + num(&d[6..8]), num(&d[8..10]), num(&d[10..12]))
}

/// Either form of PRC resident ID (used by the `cn-id` custom validator).
pub fn cn_id_any(s: &str) -> bool {
    cn_resident_id(s) || cn_resident_id_legacy(s)
}

/// US Social Security number ranges: area 001-899 except 666, group 01-99,
/// serial 0001-9999, and not one of the numbers famously published in ads.
pub fn us_ssn(s: &str) -> bool {
    let d = digits(s);
    if d.len() != 9 {
        return false;
    }
    let (area, group, serial) = (num(&d[..3]), num(&d[3..5]), num(&d[5..]));
    if area == 0 || area == 666 || area >= 900 || group == 0 || serial == 0 {
        return false;
    }
    // Invalidated numbers: the Woolworth wallet card, an ad sample, and the
    // number everyone types as an example.
    !matches!(
        (area, group, serial),
        (78, 5, 1120) | (219, 9, 9999) | (123, 45, 6789)
    )
}

/// Shannon entropy of `s` in bits per character.
pub fn shannon_entropy(s: &str) -> f64 {
    let mut counts = [0u32; 256];
    let mut n = 0u32;
    for b in s.bytes() {
        counts[b as usize] += 1;
        n += 1;
    }
    if n == 0 {
        return 0.0;
    }
    let n = f64::from(n);
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = f64::from(c) / n;
            -p * p.log2()
        })
        .sum()
}

/// base64url without padding, lenient as text found in the wild needs: the
/// trailing bits of the last character need not be zero.
const BASE64URL_LENIENT: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_allow_trailing_bits(true)
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::RequireNone),
);

/// Decode base64url (as used in JWT segments), as found in text: unpadded or
/// padded (decoding stops at the first `=`), the standard alphabet's `+` and `/`
/// taken for `-` and `_`, and a dangling last character (a length of 4n + 1)
/// ignored. None on any other character.
pub fn base64url_decode(s: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    let body = s.split('=').next().unwrap_or_default();
    let mut b: Vec<u8> = body
        .bytes()
        .map(|c| match c {
            b'+' => b'-',
            b'/' => b'_',
            c => c,
        })
        .collect();
    if b.len() % 4 == 1 {
        // Six bits make no byte; the character must still be one of the alphabet.
        let last = b.pop()?;
        if !(last.is_ascii_alphanumeric() || last == b'-' || last == b'_') {
            return None;
        }
    }
    BASE64URL_LENIENT.decode(&b).ok()
}

/// Spanish DNI (8 digits + letter) or NIE (X/Y/Z + 7 digits + letter): the
/// letter is `TRWAGMYFPDXBNJZSQVHLCKE[n mod 23]` (Real Decreto 1553/2005).
pub fn es_dni(s: &str) -> bool {
    let c = compact(s);
    if c.len() != 9 {
        return false;
    }
    let (head, letter) = (&c[..8], c[8]);
    let lead = match head[0] {
        b'X' => b'0',
        b'Y' => b'1',
        b'Z' => b'2',
        d => d,
    };
    if !lead.is_ascii_digit() || !head[1..].iter().all(u8::is_ascii_digit) {
        return false;
    }
    let n = std::iter::once(lead)
        .chain(head[1..].iter().copied())
        .fold(0u32, |a, d| a * 10 + u32::from(d - b'0'));
    b"TRWAGMYFPDXBNJZSQVHLCKE"[(n % 23) as usize] == letter
}

/// Korean resident registration number `YYMMDD-GNNNNNN`: a real birth date
/// and a century/sex digit 1–4 (numbers issued since 2020 carry no check
/// digit, so none is verified).
pub fn kr_rrn_date(s: &str) -> bool {
    let d = digits(s);
    if d.len() != 13 || !(1..=4).contains(&d[6]) {
        return false;
    }
    let century = if d[6] <= 2 { 1900 } else { 2000 };
    let y = century + num(&d[0..2]);
    valid_date(y, num(&d[2..4]), num(&d[4..6]))
}

/// French NIR (numéro de sécurité sociale): 13 characters and a 2-digit key
/// = 97 − (number mod 97); Corsica's `2A`/`2B` count as 19/18.
pub fn fr_nir(s: &str) -> bool {
    let c = compact(s);
    if c.len() != 15 {
        return false;
    }
    let body: String = String::from_utf8_lossy(&c[..13]).into_owned();
    let body = body.replace("2A", "19").replace("2B", "18");
    if !body.bytes().all(|b| b.is_ascii_digit()) || !c[13..].iter().all(u8::is_ascii_digit) {
        return false;
    }
    let n = body
        .bytes()
        .fold(0u64, |a, b| (a * 10 + u64::from(b - b'0')) % 97);
    let key = u64::from(c[13] - b'0') * 10 + u64::from(c[14] - b'0');
    97 - n == key
}

/// German Steuer-Identifikationsnummer: 11 digits, no leading zero, check
/// digit by ISO 7064 MOD 11,10.
pub fn de_steuer_id(s: &str) -> bool {
    let d = digits(s);
    if d.len() != 11 || d[0] == 0 {
        return false;
    }
    let mut product = 10u32;
    for &x in &d[..10] {
        let mut sum = (u32::from(x) + product) % 10;
        if sum == 0 {
            sum = 10;
        }
        product = (sum * 2) % 11;
    }
    let check = (11 - product) % 10;
    check == u32::from(d[10])
}

/// Japanese My Number (個人番号): 12 digits, the last a check digit over
/// the first 11 (weights 6,5,4,3,2,7,6,5,4,3,2 from the left; 11 − sum mod
/// 11, 0 when that is 10 or 11).
pub fn jp_my_number(s: &str) -> bool {
    let d = digits(s);
    if d.len() != 12 {
        return false;
    }
    const W: [u32; 11] = [6, 5, 4, 3, 2, 7, 6, 5, 4, 3, 2];
    let sum: u32 = d[..11].iter().zip(W).map(|(&x, w)| u32::from(x) * w).sum();
    let r = sum % 11;
    let check = if r <= 1 { 0 } else { 11 - r };
    check == u32::from(d[11])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn luhn_accepts_valid_and_rejects_one_digit_off() {
        assert!(luhn("4539 1488 0343 6467"));
        assert!(!luhn("4539 1488 0343 6468"));
        assert!(luhn("79927398713"));
        assert!(!luhn("7"));
    }

    #[test]
    fn card_iin_and_length() {
        assert!(plausible_card_iin("4539148803436467"));
        assert!(plausible_card_iin("378282246310005")); // Amex 15
        assert!(!plausible_card_iin("37828224631000")); // Amex 14
        assert!(plausible_card_iin("6222021234567890123")); // UnionPay 19
        assert!(!plausible_card_iin("1234567812345670")); // no network starts with 1
        assert!(!plausible_card_iin("9999999999999995"));
    }

    #[test]
    fn iban_checks() {
        assert!(iban_mod97("GB82 WEST 1234 5698 7654 32"));
        assert!(iban_mod97("DE89370400440532013000"));
        assert!(!iban_mod97("DE89370400440532013001"));
        assert!(!iban_mod97("GB82WEST123456987654")); // wrong length for GB
        assert!(!iban_mod97("XX82WEST12345698765432")); // unknown country
    }

    #[test]
    fn cn_id_checks() {
        assert!(cn_resident_id("11010519491231002X"));
        assert!(cn_resident_id("11010519491231002x"));
        assert!(!cn_resident_id("110105194912310021")); // wrong check char
        assert!(!cn_resident_id("990105194912310029")); // bad region
        assert!(!cn_resident_id("110105194902300021")); // Feb 30
        assert!(cn_resident_id_legacy("110105491231002"));
        assert!(!cn_resident_id_legacy("110105491331002")); // month 13
    }

    #[test]
    fn ssn_ranges() {
        assert!(us_ssn("536-22-1234"));
        assert!(!us_ssn("666-22-1234"));
        assert!(!us_ssn("000-22-1234"));
        assert!(!us_ssn("912-22-1234"));
        assert!(!us_ssn("536-00-1234"));
        assert!(!us_ssn("536-22-0000"));
        assert!(!us_ssn("123-45-6789"));
    }

    #[test]
    fn entropy_orders_strings() {
        assert!(shannon_entropy("aaaaaaaa") < 0.01);
        assert!(shannon_entropy("hunter2") < shannon_entropy("q8Zr!x2LwP0v#Kd9"));
    }

    #[test]
    fn base64url() {
        assert_eq!(
            base64url_decode("eyJhbGciOiJIUzI1NiJ9").as_deref(),
            Some(&b"{\"alg\":\"HS256\"}"[..])
        );
        assert_eq!(base64url_decode("a*b"), None);
    }

    /// The hand-written decoder `base64url_decode` replaced: the crate-backed one
    /// must answer as it did.
    fn base64url_decode_by_hand(s: &str) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(s.len() * 3 / 4);
        let mut buf = 0u32;
        let mut bits = 0u32;
        for b in s.bytes() {
            let v = match b {
                b'A'..=b'Z' => b - b'A',
                b'a'..=b'z' => b - b'a' + 26,
                b'0'..=b'9' => b - b'0' + 52,
                b'-' | b'+' => 62,
                b'_' | b'/' => 63,
                b'=' => break,
                _ => return None,
            };
            buf = (buf << 6) | u32::from(v);
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                out.push((buf >> bits) as u8);
                buf &= (1 << bits) - 1;
            }
        }
        Some(out)
    }

    #[test]
    fn base64url_answers_as_the_hand_written_decoder() {
        for s in [
            "",
            "e",
            "ey",
            "eyJ",
            "eyJh",
            "eyJhb",
            "eyJhbGciOiJIUzI1NiJ9",
            "eyJhbGciOiJIUzI1NiJ9=",
            "eyJ=hbG",
            "a*b",
            "ab=*",
            "+/+/",
            "-_-_",
            "ab+c/d",
            "AB==",
            "ABC=",
            "A===",
            "QUJD",
            "QUJDRA",
            "QUJDRA==",
            "QUJDRB",
            "a b",
            "é",
        ] {
            assert_eq!(base64url_decode(s), base64url_decode_by_hand(s), "{s:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn base64url_equals_the_hand_written_decoder(s in "[A-Za-z0-9+/_=*. -]{0,24}") {
            proptest::prop_assert_eq!(base64url_decode(&s), base64url_decode_by_hand(&s));
        }
    }

    #[test]
    fn national_id_checks() {
        assert!(es_dni("12345678Z"));
        assert!(es_dni("12345678-z"));
        assert!(!es_dni("12345678A"));
        assert!(es_dni("X1234567L"));
        assert!(kr_rrn_date("850315-1234567"));
        assert!(!kr_rrn_date("851315-1234567"));
        assert!(!kr_rrn_date("850315-5234567"));
        // 1 84 12 75 108 234 + key 97 - (n mod 97)
        let body = 1_841_275_108_234u64;
        let key = 97 - body % 97;
        assert!(fr_nir(&format!("{body}{key:02}")));
        assert!(!fr_nir(&format!("{body}{:02}", (key + 1) % 100)));
        assert!(de_steuer_id("86095742719"));
        assert!(!de_steuer_id("86095742718"));
        assert!(jp_my_number("123456789018"));
        assert!(!jp_my_number("123456789012"));
    }
}
