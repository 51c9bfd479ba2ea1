//! Recognizers for the formats people actually type (issue 32), beside the
//! ones in `recognizers.rs`: spelled-out and bracketed e-mail addresses
//! (`jane dot doe at gmail dot com`, `m.rossi(at)libero(dot)it`,
//! `wanglei#qq.com（#换成@）`), landlines and mobiles written the way each
//! country writes them (JP/KR `03-3461-2287`, `010-9876-5432`; FR
//! `01 42 68 53 00`; ES `91 523 47 86`, `612 345 678`; DE `(089) 21 80 44 21`,
//! `0171 4432190`; CN `010-6552 8899`), national identity and tax numbers
//! with their checks (Spanish DNI/NIE, French NIR, German Steuer-ID, Japanese
//! My Number, Korean RRN), and self-introductions in Spanish, German,
//! French, Japanese and Korean (`me llamo`, `ich heiße`, `je m'appelle`,
//! `私は…です`, `제 이름은`).
//!
//! Scores follow the calibration of `recognizers.rs`: a shape alone starts
//! below the 0.5 threshold, a passing checksum or a context word lifts it.

use crate::recognizers::{floor_boundary, pat, sc, Pattern, Scored};
use crate::types::EntityKind;
use crate::validate;

/// Every pattern of this module.
pub(crate) fn patterns() -> Vec<Pattern> {
    use EntityKind::*;
    let phone = |re: &str, check| pat(Phone, re, check, crate::recognizers::PHONE_CONTEXT, 0.45);
    vec![
        Pattern {
            penalize_negative: false,
            bounded: false,
            ..pat(
                Email,
                concat!(
                    r"(?i)[a-z0-9_%+-]+(?:(?:\.|\s+(?:dot|punto|punkt|point)\s+)[a-z0-9_%+-]+)*",
                    r"\s*(?:\[at\]|\(at\)|\{at\}|<at>|\s(?:at|arroba|arobase|アット)\s|#)\s*",
                    r"[a-z0-9-]+(?:(?:\s*(?:\[dot\]|\(dot\)|\(punkt\)|\(point\)|\{dot\})\s*|\s(?:dot|punto|punkt|point)\s|\.)[a-z0-9-]+)*",
                    r"(?:\s*(?:\[dot\]|\(dot\)|\(punkt\)|\(point\)|\{dot\})\s*|\s(?:dot|punto|punkt|point)\s|\.)",
                    r"(?:com|net|org|edu|gov|info|biz|io|co|me|app|dev|ai|de|fr|es|it|jp|kr|cn|uk|ru|nl|be|ch|at|se|no|dk|fi|pl|pt|br|mx|ar|in|au|ca|us|eu|tw|hk|sg)(?-u:\b)"
                ),
                check_obfuscated_email,
                &[],
                0.0,
            )
        },
        // JP / KR: area or mobile prefix, dashes.
        phone(r"0[1-9][0-9]{0,3}-[0-9]{2,4}-[0-9]{4}", check_dashed_phone)
            .needs(0, 10)
            .windowed(8),
        // FR: five pairs.
        phone(r"0[1-9](?:[ .][0-9]{2}){4}", check_fr_phone)
            .needs(0, 10)
            .windowed(10),
        // ES: 3-3-3 mobiles and landlines, 2-3-2-2 landlines.
        phone(
            r"[6789][0-9]{2} [0-9]{3} [0-9]{3}|[89][0-9] [0-9]{3} [0-9]{2} [0-9]{2}",
            check_es_phone,
        )
        .needs(0, 9)
        .windowed(9),
        // DE: (0area) groups; mobiles 015x/016x/017x.
        phone(
            r"\(0[1-9][0-9]{1,4}\) ?[0-9]{2,4}(?: [0-9]{2,4}){0,3}|01[5-7][0-9]{1,2} ?[0-9]{6,8}",
            check_de_phone,
        )
        .needs(0, 10)
        .windowed(5),
        // CN landline with a separated subscriber number.
        phone(
            r"(?:\(0[1-9][0-9]{1,2}\) ?|0[1-9][0-9]{1,2}-)[0-9]{3,4}[ -][0-9]{4}",
            check_cn_landline_grouped,
        )
        .needs(0, 10)
        .windowed(10),
        pat(
            NationalId,
            r"[0-9]{8}-?[A-Za-z]|[XYZxyz]-?[0-9]{7}-?[A-Za-z]",
            check_es_dni,
            &["dni", "nie", "nif", "documento", "d.n.i", "identidad"],
            0.35,
        )
        .needs(7, 0)
        .windowed(7),
        pat(
            NationalId,
            r"[0-9]{6}-[1-4][0-9]{6}",
            check_kr_rrn,
            &[
                "주민등록번호",
                "주민번호",
                "주민등록",
                "rrn",
                "resident registration",
            ],
            0.4,
        )
        .needs(6, 13)
        .windowed(13),
        pat(
            NationalId,
            r"[12] ?[0-9]{2} ?[0-9]{2} ?(?:[0-9]{2}|2[AB]) ?[0-9]{3} ?[0-9]{3} ?[0-9]{2}",
            check_fr_nir,
            &[
                "sécurité sociale",
                "securite sociale",
                "sécu",
                "nir",
                "carte vitale",
                "numéro de sécu",
            ],
            0.4,
        )
        .needs(0, 15)
        .windowed(6),
        pat(
            NationalId,
            r"[1-9][0-9] ?[0-9]{3} ?[0-9]{3} ?[0-9]{3}",
            check_de_steuer_id,
            &[
                "steuer-id",
                "steuerid",
                "steuer-identifikationsnummer",
                "steueridentifikationsnummer",
                "identifikationsnummer",
                "idnr",
                "tax id",
            ],
            0.45,
        )
        .needs(0, 11)
        .windowed(11),
        pat(
            NationalId,
            r"[0-9]{4} ?[0-9]{4} ?[0-9]{4}",
            check_jp_my_number,
            &["マイナンバー", "個人番号", "my number"],
            0.45,
        )
        .needs(0, 12)
        .windowed(12),
        Pattern {
            group: 1,
            bounded: false,
            penalize_negative: false,
            ..pat(
                PersonName,
                r"(?:[Mm]e llamo|[Mm]i nombre es|[Ii]ch heiße|[Ii]ch heisse|[Mm]ein [Nn]ame ist|[Jj]e m'appelle|[Jj]e m’appelle|[Mm]on nom est)\s+(\p{Lu}\p{Ll}+(?:[ -]\p{Lu}\p{Ll}+){0,3})",
                check_intro_name,
                &[],
                0.0,
            )
        },
        Pattern {
            group: 1,
            bounded: false,
            penalize_negative: false,
            ..pat(
                PersonName,
                r"(?:私の名前は|名前は|私は|わたしは)(\p{Han}{3,5})(?:です|と申します|といいます)",
                check_cjk_intro_name,
                &[],
                0.0,
            )
        },
        Pattern {
            group: 1,
            bounded: false,
            penalize_negative: false,
            ..pat(
                PersonName,
                r"(?:제 이름은|내 이름은|이름은|이름[:：])\s*(\p{Hangul}{2,4}?)(?:이고|이에요|예요|입니다|이라고|라고|\s|[,.]|$)",
                check_field_name,
                &[],
                0.0,
            )
        },
        Pattern {
            group: 1,
            bounded: false,
            penalize_negative: false,
            ..pat(
                PersonName,
                r#""(?:氏名|姓名|名前|이름|성명)"\s*:\s*"(\p{Han}{2,5}|\p{Hangul}{2,4})""#,
                check_field_name,
                &[],
                0.0,
            )
        },
    ]
}

/// A spelled-out or bracketed address. The `#` form (`wanglei#qq.com`)
/// counts only when the text says what `#` stands for (an `@` right after).
fn check_obfuscated_email(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    let lower = m.to_ascii_lowercase();
    let bracketed = ["[at]", "(at)", "{at}", "<at>"]
        .iter()
        .any(|w| lower.contains(w));
    let spelled = [" at ", " arroba ", " arobase ", " アット "]
        .iter()
        .any(|w| lower.contains(w));
    let hash = !bracketed && !spelled && m.contains('#');
    if !bracketed && !spelled && !hash {
        return None; // a plain address: recognizers.rs has it
    }
    if hash {
        // 40 bytes may end inside a character: round down to a boundary.
        let after = &text[e..floor_boundary(text, e.saturating_add(40))];
        if !after.contains('@') {
            return None;
        }
    }
    // "look at this dot com": a spelled form needs a dot word or a dot in
    // the domain and a local part that is not a stop word.
    let local = lower
        .split([' ', '[', '(', '{', '<', '#'])
        .next()
        .unwrap_or("");
    if [
        "look", "me", "us", "him", "her", "them", "it", "this", "that",
    ]
    .contains(&local)
    {
        return None;
    }
    sc(s, e, 0.75)
}

fn digit_count(s: &str) -> usize {
    s.bytes().filter(u8::is_ascii_digit).count()
}

/// JP/KR dashed numbers: 10–11 digits; mobile prefixes score higher.
fn check_dashed_phone(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    if !(10..=11).contains(&digit_count(m)) {
        return None;
    }
    let mobile = [
        "010-", "011-", "016-", "017-", "019-", "070-", "080-", "090-",
    ]
    .iter()
    .any(|p| m.starts_with(p));
    sc(s, e, if mobile { 0.5 } else { 0.4 })
}

fn check_fr_phone(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    // One kind of separator throughout.
    if m.contains(' ') && m.contains('.') {
        return None;
    }
    let mobile = m.starts_with("06") || m.starts_with("07");
    sc(s, e, if mobile { 0.45 } else { 0.35 })
}

fn check_es_phone(_t: &str, s: usize, e: usize) -> Option<Scored> {
    sc(s, e, 0.3)
}

fn check_de_phone(text: &str, s: usize, e: usize) -> Option<Scored> {
    let n = digit_count(&text[s..e]);
    if !(10..=12).contains(&n) {
        return None;
    }
    sc(s, e, 0.4)
}

fn check_cn_landline_grouped(text: &str, s: usize, e: usize) -> Option<Scored> {
    let n = digit_count(&text[s..e]);
    if !(10..=12).contains(&n) {
        return None;
    }
    sc(s, e, 0.45)
}

fn check_es_dni(text: &str, s: usize, e: usize) -> Option<Scored> {
    sc(
        s,
        e,
        if validate::es_dni(&text[s..e]) {
            0.45
        } else {
            0.2
        },
    )
}

fn check_kr_rrn(text: &str, s: usize, e: usize) -> Option<Scored> {
    validate::kr_rrn_date(&text[s..e]).then_some(Scored {
        start: s,
        end: e,
        score: 0.35,
    })
}

fn check_fr_nir(text: &str, s: usize, e: usize) -> Option<Scored> {
    sc(
        s,
        e,
        if validate::fr_nir(&text[s..e]) {
            0.6
        } else {
            0.15
        },
    )
}

fn check_de_steuer_id(text: &str, s: usize, e: usize) -> Option<Scored> {
    sc(
        s,
        e,
        if validate::de_steuer_id(&text[s..e]) {
            0.3
        } else {
            0.1
        },
    )
}

fn check_jp_my_number(text: &str, s: usize, e: usize) -> Option<Scored> {
    sc(
        s,
        e,
        if validate::jp_my_number(&text[s..e]) {
            0.3
        } else {
            0.1
        },
    )
}

fn check_intro_name(_t: &str, s: usize, e: usize) -> Option<Scored> {
    sc(s, e, 0.8)
}

/// `私は山田花子です`: 3–5 Han characters not ending like an occupation or
/// a nationality (`会社員`, `大学生`, `日本人`, `看護師`); `제 이름은 김민수`.
fn check_cjk_intro_name(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    let last = m.chars().next_back()?;
    if "員生人者師婦長家手士".contains(last) {
        return None;
    }
    sc(s, e, 0.7)
}

fn check_field_name(_t: &str, s: usize, e: usize) -> Option<Scored> {
    sc(s, e, 0.7)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hits(text: &str) -> Vec<(String, String, f32)> {
        let mut out = Vec::new();
        for p in patterns() {
            p.scan(text, &mut out);
        }
        out.into_iter()
            .map(|(k, s, e, sc)| (k.as_str().to_string(), text[s..e].to_string(), sc))
            .collect()
    }

    fn found(text: &str, kind: &str, value: &str) -> bool {
        hits(text)
            .iter()
            .any(|(k, v, s)| k == kind && v.contains(value) && *s >= 0.5)
    }

    #[test]
    fn obfuscated_emails() {
        assert!(found(
            "write to jane dot okafor at gmail dot com",
            "EMAIL",
            "okafor"
        ));
        assert!(found(
            "reach me: m.rossi(at)libero(dot)it",
            "EMAIL",
            "rossi"
        ));
        assert!(found(
            "correo: carlos punto ruiz arroba gmail punto com",
            "EMAIL",
            "ruiz"
        ));
        assert!(found("邮箱 wl1988#qq.com（#换成@）", "EMAIL", "qq"));
        assert!(found("tanaka.k アット docomo.ne.jp", "EMAIL", "docomo"));
        // A sentence is not an address: "pay it all at once. How".
        assert!(!found(
            "I can't pay it all at once. How do I",
            "EMAIL",
            "once"
        ));
        // A URL fragment is not an address; neither is "look at this dot com".
        assert!(!found("see index.html#setup.md", "EMAIL", "setup"));
        assert!(!found("look at this dot com bubble", "EMAIL", "this"));
        // A plain address is left to the main recognizer.
        assert!(hits("a@b.com").is_empty());
    }

    #[test]
    fn phones_as_each_country_writes_them() {
        for (text, value) in [
            ("自宅の電話は03-3461-2287です", "03-3461-2287"),
            ("휴대폰 010-9876-5432", "010-9876-5432"),
            ("Mon fixe : 01 42 68 53 00", "01 42 68 53 00"),
            ("Llámame al fijo 91 523 47 86", "91 523 47 86"),
            ("móvil 612 345 678", "612 345 678"),
            ("Festnetz (089) 21 80 44 21", "(089) 21 80 44 21"),
            ("mobil 0171 4432190", "0171 4432190"),
            ("座机 010-6552 8899", "010-6552 8899"),
        ] {
            assert!(found(text, "PHONE", value), "{text}");
        }
        // Without context a bare landline shape stays under the threshold.
        assert!(!found("ratio 01 42 68 53 00", "PHONE", "01 42"));
    }

    #[test]
    fn national_ids_need_context_or_a_checksum() {
        // 12345678Z passes the DNI letter check.
        assert!(found("Mi DNI es 12345678Z", "NATIONAL_ID", "12345678Z"));
        assert!(!found("ref 12345678A", "NATIONAL_ID", "12345678A"));
        assert!(found(
            "주민등록번호는 850315-1234567",
            "NATIONAL_ID",
            "850315-1234567"
        ));
        // An impossible date is not an RRN.
        assert!(!found(
            "주민등록번호 851345-1234567",
            "NATIONAL_ID",
            "851345"
        ));
        assert!(found(
            "numéro de sécurité sociale 1 84 12 75 108 234 56",
            "NATIONAL_ID",
            "1 84 12"
        ));
        assert!(found("Steuer-ID 47 036 892 816", "NATIONAL_ID", "47 036"));
        assert!(found(
            "マイナンバーは 4512 3847 9021",
            "NATIONAL_ID",
            "4512"
        ));
        assert!(!found("order 4512 3847 9021", "NATIONAL_ID", "4512"));
    }

    #[test]
    fn introductions() {
        assert!(found(
            "Me llamo Lucía Fernández García y vivo",
            "PERSON_NAME",
            "Lucía"
        ));
        assert!(found("Ich heiße Jonas Becker und", "PERSON_NAME", "Jonas"));
        assert!(found(
            "Je m'appelle Camille Dubois",
            "PERSON_NAME",
            "Camille"
        ));
        assert!(found("私は山田花子です。", "PERSON_NAME", "山田花子"));
        assert!(!found("私は会社員です。", "PERSON_NAME", "会社員"));
        assert!(found("제 이름은 김민수이고", "PERSON_NAME", "김민수"));
        assert!(found(r#"{"氏名": "鈴木一郎"}"#, "PERSON_NAME", "鈴木一郎"));
    }
}
