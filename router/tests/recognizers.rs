//! Every built-in recognizer: a valid value with context, without context, and
//! an invalid (checksum / range) value with context — through the public API
//! with the built-in default policy (threshold 0.5).

#![allow(clippy::unwrap_used)] // test helpers; a panic is a test failure

use tandem_router::{Action, EntityKind, Policy, RouteContext, Router};

/// (kind, matched text, score) of every entity the default policy keeps.
fn found(text: &str) -> Vec<(String, String, f32)> {
    let p = Policy::builtin_default();
    let d = p.decide(text, &RouteContext::default());
    d.entities
        .iter()
        .map(|e| {
            (
                e.kind.as_str().to_string(),
                text[e.start..e.end].to_string(),
                e.score,
            )
        })
        .collect()
}

fn has(text: &str, kind: &str, value: &str) -> bool {
    found(text).iter().any(|(k, v, _)| k == kind && v == value)
}

fn none_of(text: &str, kind: &str) -> bool {
    found(text).iter().all(|(k, _, _)| k != kind)
}

#[test]
fn email() {
    assert!(has("write to li.na42@163.com", "EMAIL", "li.na42@163.com"));
    assert!(has("li.na42@163.com", "EMAIL", "li.na42@163.com"));
    assert!(none_of("contact: someone@example.com", "EMAIL")); // RFC 2606 domain
    assert!(none_of("git clone git@github.com:o/r.git", "EMAIL"));
    assert!(none_of(
        "postgres://app:s3cretPw9@db.internal:5432/x",
        "EMAIL"
    ));
    assert!(none_of("npm i react@18.2.0", "EMAIL"));
}

#[test]
fn phone_cn_mobile_needs_context_when_bare() {
    assert!(has("手机：13912345678", "PHONE", "13912345678"));
    assert!(has("call me at 139 1234 5678", "PHONE", "139 1234 5678"));
    assert!(has("+86 13912345678", "PHONE", "+86 13912345678"));
    assert!(none_of("x = 13912345678", "PHONE"));
    assert!(none_of(
        "let phone = \"13912345678\"; // test data",
        "PHONE"
    ));
    assert!(none_of("12345678901", "PHONE")); // not a 1[3-9] prefix
}

#[test]
fn phone_other_formats() {
    assert!(has("电话 010-62345678", "PHONE", "010-62345678"));
    assert!(has("tel (415) 555-2671", "PHONE", "(415) 555-2671"));
    assert!(has("+44 20 7946 0958", "PHONE", "+44 20 7946 0958"));
    assert!(has("mobile 07700 900123", "PHONE", "07700 900123"));
    assert!(none_of("x = a+1234567 - b", "PHONE"));
    assert!(none_of("call +1 more", "PHONE"));
}

#[test]
fn cn_resident_id() {
    // Valid 18-digit: strong enough alone, stronger with context.
    let v = found("身份证号 11010519491231002X");
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].0, "CN_RESIDENT_ID");
    assert!(v[0].2 > 0.9);
    assert!(has(
        "11010519491231002X",
        "CN_RESIDENT_ID",
        "11010519491231002X"
    ));
    // Wrong check digit, bad date, bad region: never, even with context.
    assert!(none_of("身份证号 110105194912310021", "CN_RESIDENT_ID"));
    assert!(none_of("身份证号 110105194902300025", "CN_RESIDENT_ID"));
    assert!(none_of("身份证号 990105194912310029", "CN_RESIDENT_ID"));
    // Legacy 15-digit needs context.
    assert!(has(
        "身份证 110105491231002",
        "CN_RESIDENT_ID",
        "110105491231002"
    ));
    assert!(none_of("n = 110105491231002", "CN_RESIDENT_ID"));
    // Inside a longer number or a hash: no.
    assert!(none_of("身份证 911010519491231002X", "CN_RESIDENT_ID"));
}

#[test]
fn bank_card_needs_luhn_and_context() {
    assert!(has(
        "card 4539 1488 0343 6467",
        "BANK_CARD",
        "4539 1488 0343 6467"
    ));
    assert!(has(
        "银行卡号：4539-1488-0343-6467",
        "BANK_CARD",
        "4539-1488-0343-6467"
    ));
    assert!(has(
        "amex card 3714 123456 78906",
        "BANK_CARD",
        "3714 123456 78906"
    ));
    assert!(none_of("amex card 3782 822463 10005", "BANK_CARD")); // allow-listed test number
    assert!(none_of("4539148803436467", "BANK_CARD")); // valid, no context
    assert!(none_of("card 4539 1488 0343 6468", "BANK_CARD")); // Luhn fails
    assert!(none_of("card 1234 5678 9012 3452", "BANK_CARD")); // no network starts with 1
    assert!(none_of("card 4539 148 80343 6467", "BANK_CARD")); // odd grouping
    assert!(none_of("test card 4539148803436467", "BANK_CARD")); // test data
}

#[test]
fn iban() {
    assert!(has(
        "IBAN GB82 WEST 1234 5698 7654 32",
        "IBAN",
        "GB82 WEST 1234 5698 7654 32"
    ));
    assert!(has(
        "DE89370400440532013000",
        "IBAN",
        "DE89370400440532013000"
    ));
    assert!(none_of("IBAN GB83 WEST 1234 5698 7654 32", "IBAN"));
    assert!(none_of("IBAN DE8937040044053201300", "IBAN")); // too short for DE
}

#[test]
fn us_ssn() {
    assert!(has("SSN 536-22-1234", "US_SSN", "536-22-1234"));
    assert!(has(
        "social security number 536 22 1234",
        "US_SSN",
        "536 22 1234"
    ));
    assert!(none_of("ref 536-22-1234", "US_SSN")); // no context
    assert!(none_of("SSN 666-22-1234", "US_SSN"));
    assert!(none_of("SSN 912-22-1234", "US_SSN"));
    assert!(none_of("SSN 123-45-6789", "US_SSN"));
    assert!(none_of("SSN 536-00-1234", "US_SSN"));
}

#[test]
fn passport_requires_context() {
    assert!(has("护照号码 E12345678", "PASSPORT", "E12345678"));
    assert!(has("passport no. 123456789", "PASSPORT", "123456789"));
    assert!(none_of("order E12345678 shipped", "PASSPORT"));
}

#[test]
fn ip_addresses() {
    assert!(has("my ip is 36.112.45.7", "IP_ADDRESS", "36.112.45.7"));
    assert!(has(
        "my IPv6 address 2408:8207:1851:3c50::1",
        "IP_ADDRESS",
        "2408:8207:1851:3c50::1"
    ));
    assert!(none_of("36.112.45.7", "IP_ADDRESS")); // public but no context
    assert!(none_of("my ip is 192.168.1.10", "IP_ADDRESS")); // private
    assert!(none_of("my ip is 127.0.0.1", "IP_ADDRESS"));
    assert!(none_of("ip 2001:db8::1", "IP_ADDRESS")); // documentation prefix
    assert!(none_of("ip version v1.2.3.4", "IP_ADDRESS"));
    assert!(none_of("ip 1.2.3.4.5", "IP_ADDRESS"));
    assert!(none_of("use std::io::Read; at 12:30:45", "IP_ADDRESS"));
}

#[test]
fn mac_addresses() {
    assert!(has(
        "mac 3c:22:fb:7a:10:9e",
        "MAC_ADDRESS",
        "3c:22:fb:7a:10:9e"
    ));
    assert!(has("3C-22-FB-7A-10-9E", "MAC_ADDRESS", "3C-22-FB-7A-10-9E"));
    assert!(none_of("mac ff:ff:ff:ff:ff:ff", "MAC_ADDRESS"));
    assert!(none_of("02:42:ac:11:00:02", "MAC_ADDRESS")); // locally administered
    assert!(none_of("mac 3c:22-fb:7a:10:9e", "MAC_ADDRESS")); // mixed separators
}

#[test]
fn secrets_provider_tokens() {
    let gh = "ghp_16C7e42F292c6912E7710c838347Ae178B4a";
    assert!(has(&format!("token {gh}"), "SECRET", gh));
    assert!(has(
        "AKIAZ7QH3L2M5N6P8R4T",
        "SECRET",
        "AKIAZ7QH3L2M5N6P8R4T"
    ));
    assert!(none_of("AKIAIOSFODNN7EXAMPLE", "SECRET"));
    assert!(none_of(
        "ghp_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
        "SECRET"
    ));
    let gl = "glpat-Ab3dE6gH9jK2mN5pQ8sT";
    assert!(has(gl, "SECRET", gl));
    let jwt = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U";
    assert!(has(&format!("Bearer {jwt}"), "SECRET", jwt));
}

#[test]
fn secrets_pem_block_span_covers_the_block() {
    let body = "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gunVTLw7onLRnrq0/IzW7yWR7QkrmBL7jTKEn5u";
    let pem = format!("-----BEGIN RSA PRIVATE KEY-----\n{body}\n-----END RSA PRIVATE KEY-----");
    let text = format!("fix this:\n{pem}\nthanks");
    assert!(has(&text, "SECRET", &pem));
}

#[test]
fn secrets_a_pem_private_key_header_alone_is_a_secret() {
    // Issue 19: whatever the body (none, elided, short, malformed, cut off),
    // the header of a private key keeps the prompt local.
    let router = Router::with_default_policy();
    for text in [
        "-----BEGIN PRIVATE KEY-----",
        "-----BEGIN PRIVATE KEY-----\n...\n-----END PRIVATE KEY-----",
        "here is my key -----BEGIN RSA PRIVATE KEY-----\nMIIEow",
        "-----BEGIN OPENSSH PRIVATE KEY-----\n!!not base64!!\n-----END OPENSSH PRIVATE KEY-----",
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nabc\n",
        "-----BEGIN PGP PRIVATE KEY BLOCK-----",
    ] {
        let header = &text[text.find("-----BEGIN").unwrap()..];
        let header = &header[..header.find("-----\n").map_or(header.len(), |i| i + 5)];
        assert!(
            found(text)
                .iter()
                .any(|(k, v, _)| k == "SECRET" && v.starts_with(header)),
            "{text:?}: {:?}",
            found(text)
        );
        let d = router.decide(text, &RouteContext::default());
        assert_eq!(d.action, Action::Local, "{text:?}: {d:?}");
    }
    // A public key or a certificate is not a secret.
    for text in [
        "-----BEGIN PUBLIC KEY-----\nMIIBIjANBgkq\n-----END PUBLIC KEY-----",
        "-----BEGIN CERTIFICATE-----\nMIIC\n-----END CERTIFICATE-----",
    ] {
        assert!(none_of(text, "SECRET"), "{text:?}");
    }
}

#[test]
fn secrets_assignments() {
    assert!(has(
        "DB_PASSWORD = \"q8Zr!x2LwP0v#Kd9\"",
        "SECRET",
        "q8Zr!x2LwP0v#Kd9"
    ));
    assert!(has("我的密码是abc123456", "SECRET", "abc123456"));
    assert!(has("my password is hunter22", "SECRET", "hunter22"));
    assert!(has(
        "postgres://admin:s3cretPw9@db/x",
        "SECRET",
        "s3cretPw9"
    ));
    for code in [
        "password = getpass.getpass()",
        "let password = env::var(\"DB_PASSWORD\")?;",
        "password: String,",
        "\"password\": \"${DB_PASSWORD}\"",
        "api_key: Optional[str] = None",
        "token = lexer.next_token()",
        "password = user_password",
        "password = '********'",
        "api_key = 'your-api-key-here'",
        "DATABASE_URL=postgres://user:${PGPASSWORD}@localhost/app",
    ] {
        assert!(none_of(code, "SECRET"), "{code}");
    }
}

#[test]
fn person_names() {
    assert!(has("我叫张伟，想咨询一下", "PERSON_NAME", "张伟"));
    assert!(has("姓名：欧阳娜娜", "PERSON_NAME", "欧阳娜娜"));
    assert!(has("我的名字是李秀英", "PERSON_NAME", "李秀英"));
    assert!(has(
        "my name is Oliver Brown",
        "PERSON_NAME",
        "Oliver Brown"
    ));
    assert!(has("Full name: Grace Young", "PERSON_NAME", "Grace Young"));
    for neg in [
        "我叫了外卖",
        "name: String",
        "name = \"Widget\"",
        "Name: Option<String>",
        "My name is not important",
        "username: Admin",
    ] {
        assert!(none_of(neg, "PERSON_NAME"), "{neg}");
    }
}

#[test]
fn code_is_not_pii() {
    for code in [
        "let id = Uuid::parse_str(\"550e8400-e29b-41d4-a716-446655440000\")?;",
        "commit 4b825dc642cb6eb9a060e54bf8d69288fbee4904",
        "sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "const MAX: u64 = 18446744073709551615;",
        "created_at = 1700000000123",
        "version = \"10.0.19041.1\"",
        "app.listen(8080)",
        "assert!(luhn(\"4539148803436467\"));",
    ] {
        let f = found(code);
        assert!(f.is_empty(), "{code}: {f:?}");
    }
}

#[test]
fn builtin_kind_names_round_trip() {
    for k in EntityKind::BUILTIN {
        assert_eq!(EntityKind::builtin(k.as_str()), Some(k.clone()));
    }
    assert_eq!(EntityKind::builtin("NOPE"), None);
}

/// Categories the default policy reports for `text`.
fn cats(text: &str) -> Vec<String> {
    let p = Policy::builtin_default();
    p.decide(text, &RouteContext::default()).categories
}

#[test]
fn contact_record_name_before_mobile() {
    // A name directly followed by a CN mobile: both count, no context word.
    assert!(has("订单备注：孙丽 15011112222", "PERSON_NAME", "孙丽"));
    assert!(has("订单备注：孙丽 15011112222", "PHONE", "15011112222"));
    assert!(has(
        "欧阳娜娜，+86 150 1111 2222",
        "PERSON_NAME",
        "欧阳娜娜"
    ));
    assert!(has("孙丽15011112222", "PHONE", "15011112222"));
    // A longer Han run is a sentence, not a name; no surname, no name.
    assert!(none_of("把这段代码里的 15011112222 换掉", "PHONE"));
    assert!(none_of("把这段代码里的 15011112222 换掉", "PERSON_NAME"));
    assert!(none_of("测试账号 15011112222", "PHONE"));
    assert!(none_of("测试账号 15011112222", "PERSON_NAME"));
    // The number must be a whole mobile number.
    assert!(none_of("孙丽 150111122223", "PERSON_NAME"));
}

#[test]
fn contact_record_mobile_next_to_an_address() {
    let t = "15011112222 上海市浦东新区张江路100号";
    assert!(has(t, "PHONE", "15011112222"));
    assert_eq!(cats(t), ["location"]);
    // Far from any address the bare number still needs a context word.
    assert!(none_of("15011112222 appears in the fixture list", "PHONE"));
}

#[test]
fn structured_addresses_are_locations() {
    assert_eq!(cats("寄到江苏省南京市鼓楼区中山路18号"), ["location"]);
    assert_eq!(cats("公司在滨江路66号3栋502室"), ["location"]);
    assert_eq!(cats("武汉市洪山区光谷花园"), ["location"]);
    assert_eq!(cats("she lives at 1600 Pennsylvania Avenue"), ["location"]);
    assert_eq!(cats("send it to 221B Baker Street"), ["location"]);
    assert!(cats("写一个解析地址的函数，输入省市区和路名").is_empty());
    assert!(cats("第3号参数是 port").is_empty());
    assert!(cats("upload 2 files to Google Drive").is_empty());
}

#[test]
fn ip_address_of_a_server_someone_logs_into() {
    assert!(has("ssh root@81.70.12.9 hangs", "IP_ADDRESS", "81.70.12.9"));
    assert!(has(
        "我的服务器 81.70.12.9 被扫描",
        "IP_ADDRESS",
        "81.70.12.9"
    ));
    assert!(none_of("ping 81.70.12.9 drops packets", "IP_ADDRESS"));
    assert!(none_of("ssh root@10.1.2.3", "IP_ADDRESS")); // private
}

#[test]
fn secrets_env_var_literals() {
    assert!(has(
        "export REDIS_PASSWORD=opensesame",
        "SECRET",
        "opensesame"
    ));
    assert!(has(
        "  DB_PASSWORD: letmeinplease",
        "SECRET",
        "letmeinplease"
    ));
    assert!(none_of("export REDIS_PASSWORD=$REDIS_PASSWORD", "SECRET"));
    assert!(none_of("API_KEY=DEFAULT_API_KEY", "SECRET")); // a constant's name
    assert!(none_of("password = user_password", "SECRET")); // a variable
    assert!(none_of("db_password=vault_lookup", "SECRET")); // lower-case key: code
}

#[test]
fn secrets_credential_pairs_and_cli_flags() {
    assert!(has(
        "session.auth = ('bob', 'Kx8#pq2Lm')",
        "SECRET",
        "Kx8#pq2Lm"
    ));
    assert!(has(
        "HTTPBasicAuth(\"svc-user\", \"winter-is-here\")",
        "SECRET",
        "winter-is-here"
    ));
    assert!(none_of("auth=(user, password)", "SECRET"));
    assert!(none_of("auth=('user', os.environ['PW'])", "SECRET"));
    assert!(none_of("auth=('user', '<password>')", "SECRET"));
    assert!(has(
        "curl -u admin:Tr0ub4dor https://x.internal",
        "SECRET",
        "Tr0ub4dor"
    ));
    assert!(none_of("curl -u admin:$PASS https://x.internal", "SECRET"));
    assert!(has(
        "mysqldump -u root -pQz81kd shop > x.sql",
        "SECRET",
        "Qz81kd"
    ));
    assert!(none_of("mysql -u root -p shop", "SECRET")); // prompts for it
    assert!(none_of("grep -pattern file", "SECRET"));
    assert!(has("redis-cli --pass Lm9zQ2xw ping", "SECRET", "Lm9zQ2xw"));
    assert!(has("sshpass -p 'Lm9zQ2xw' ssh host", "SECRET", "Lm9zQ2xw"));
    assert!(none_of("redis-cli --pass \"$REDIS_PW\" ping", "SECRET"));
}

#[test]
fn english_introductions() {
    assert!(has(
        "Hello, I'm Wei Zhang, a backend dev",
        "PERSON_NAME",
        "Wei Zhang"
    ));
    assert!(has(
        "I'm Amara and I need a cover letter",
        "PERSON_NAME",
        "Amara"
    ));
    assert!(none_of("I'm Getting Started with Rust", "PERSON_NAME"));
    assert!(none_of("I'm Stuck on this borrow error", "PERSON_NAME"));
    assert!(none_of("I'm Chinese, is that relevant?", "PERSON_NAME"));
    assert!(none_of("I'm Using Tokio here", "PERSON_NAME"));
}

#[test]
fn health_symptoms_medications_pregnancy() {
    assert_eq!(cats("发烧38度，能吃对乙酰氨基酚吗"), ["health"]);
    assert_eq!(cats("we're expecting twins in June"), ["health"]);
    assert_eq!(cats("I have a migraine again"), ["health"]);
    assert_eq!(cats("最近失眠，医生开了安眠药"), ["health"]);
    assert!(cats("the function has a side effect").is_empty());
    assert!(cats("fix the memory leak symptoms").is_empty());
    assert!(cats("CPU 发热严重，帮我优化这个循环").is_empty());
    assert!(cats("模型的假阳性率太高").is_empty());
    assert!(cats("grep on steroids: ripgrep").is_empty());
}

#[test]
fn finance_and_legal_need_the_first_person() {
    // `~` terms count with a first-person marker near them...
    assert_eq!(cats("I'm three months behind on the mortgage"), ["finance"]);
    assert_eq!(cats("我的贷款这个月还不上了"), ["finance"]);
    assert_eq!(cats("my landlord hired a lawyer against me"), ["legal"]);
    assert_eq!(cats("我下个月要出庭作证"), ["legal"]);
    // ... and are a topic without one.
    assert!(cats("Explain how a mortgage works").is_empty());
    assert!(cats("什么是个人所得税汇算清缴").is_empty());
    assert!(cats("What does a lawyer do at a deposition?").is_empty());
    // A request phrase's first person asks for a task; it owns nothing.
    assert!(cats("How do I refinance a mortgage in general?").is_empty());
    assert!(cats("帮我写一个贷款审批流程的说明").is_empty());
    assert!(cats("我们公司的贷款产品介绍").is_empty());
    // Lower-case `i` is a loop index, not the writer.
    assert!(cats("for i in loans: total += i.amount  # loan rows").is_empty());
    // The marker must be on the same line.
    assert!(cats("my notes\n\n\nmortgage rates explained").is_empty());
    // Plain terms still count alone.
    assert_eq!(cats("filed for divorce last week"), ["legal"]);
    assert_eq!(cats("信用卡欠款两万还不上了怎么办"), ["finance"]);
}

#[test]
fn finance_and_legal_terms_in_code_do_not_count() {
    // Identifiers and parts of them.
    assert!(cats("My test for calculate_tax(income=50000) fails").is_empty());
    assert!(cats("my code reads self.salary and Account::balance").is_empty());
    assert!(cats("I print loan.rate and salary[0] in my loop").is_empty());
    // A term followed by a software word names software.
    assert!(cats("refactor the loan calculator module").is_empty());
    assert!(cats("我在写一个工资管理系统").is_empty());
    // A `~` term with a software word nearby is a programming task.
    assert!(cats("In my React app the credit score gauge doesn't animate").is_empty());
    assert!(cats("我的代码里转账函数有并发问题，余额会变成负数").is_empty());
    assert!(cats("I need to store the salary of each employee in Postgres").is_empty());
    // Benign senses hide the terms they overlap.
    assert!(cats("I'm on the free trial of your API plan").is_empty());
    assert!(cats("Can you review my smart contract's transfer logic?").is_empty());
    assert!(cats("I owe you one, thanks").is_empty());
    assert!(cats("I'll write my online judge solution in C++").is_empty());
    // But the same words about the writer count.
    assert_eq!(cats("I'm on trial for fraud next month"), ["legal"]);
    assert_eq!(cats("I owe the IRS $8,400"), ["finance"]);
}

#[test]
fn a_rejected_longer_term_does_not_hide_a_shorter_one() {
    // "my debt" is the head of a hyphenated compound here and does not
    // count; "debt-to-income" still does.
    assert_eq!(
        cats("the bank mentions my debt-to-income ratio"),
        ["finance"]
    );
}
