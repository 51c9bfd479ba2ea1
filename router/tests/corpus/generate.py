#!/usr/bin/env python3
"""Generate the templated part of the router's labelled corpus.

Writes generated_*.jsonl next to this file. Deterministic (fixed seed). The
hand-written cases live in handwritten.jsonl and are not touched.

Each case: {"id", "text", "entities": [{"type", "value"}], "categories": [...],
"decision": "local"|"speculative", "note"?}. `value` is the exact sensitive
substring; the test locates it in `text` to get the expected span. The
expected decision is for config/policy.example.toml with an idle context:
local iff an entity or a category is expected.

Checksummed values (resident IDs, cards, IBANs) are computed here, so every
"valid" value really validates and every "invalid" one really fails.
"""
import base64
import json
import os
import random
import string

R = random.Random(20261129)
HERE = os.path.dirname(os.path.abspath(__file__))

# ---- value generators ---------------------------------------------------------

REGIONS = ["110105", "110108", "310104", "310115", "440305", "440106", "510107",
           "330106", "420102", "610113", "370202", "320106", "500103", "210102"]
CN_W = [7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2]
CN_C = "10X98765432"


def cn_id(valid=True):
    y = R.randint(1950, 2008)
    m = R.randint(1, 12)
    d = R.randint(1, 28)
    body = f"{R.choice(REGIONS)}{y:04d}{m:02d}{d:02d}{R.randint(0, 999):03d}"
    c = CN_C[sum(int(a) * w for a, w in zip(body, CN_W)) % 11]
    if not valid:
        c = CN_C[(CN_C.index(c) + R.randint(1, 10)) % 11]
    return body + c


def luhn_digit(partial):
    total = 0
    for i, ch in enumerate(reversed(partial)):
        x = int(ch)
        if i % 2 == 0:
            x *= 2
            if x > 9:
                x -= 9
        total += x
    return str((10 - total % 10) % 10)


def card_digits(valid=True):
    kind = R.choice(["visa", "mc", "unionpay", "amex", "unionpay19"])
    prefix, n = {"visa": ("4", 16), "mc": (str(R.randint(51, 55)), 16),
                 "unionpay": ("62" + str(R.randint(1, 2)), 16), "amex": (R.choice(["34", "37"]), 15),
                 "unionpay19": ("622", 19)}[kind]
    body = prefix + "".join(R.choice(string.digits) for _ in range(n - len(prefix) - 1))
    d = luhn_digit(body)
    if not valid:
        d = str((int(d) + R.randint(1, 9)) % 10)
    return body + d


def fmt_card(d, sep=None):
    sep = R.choice(["", " ", "-"]) if sep is None else sep
    if len(d) == 15:
        return sep.join([d[:4], d[4:10], d[10:]])
    return sep.join(d[i:i + 4] for i in range(0, len(d), 4))


def iban():
    country = R.choice(["DE", "GB", "NL", "FR"])
    if country == "DE":
        bban = "".join(R.choice(string.digits) for _ in range(18))
    elif country == "GB":
        bban = "".join(R.choice(string.ascii_uppercase) for _ in range(4)) + \
            "".join(R.choice(string.digits) for _ in range(14))
    elif country == "NL":
        bban = "".join(R.choice(string.ascii_uppercase) for _ in range(4)) + \
            "".join(R.choice(string.digits) for _ in range(10))
    else:
        bban = "".join(R.choice(string.digits) for _ in range(23))
    num = "".join(str(int(ch, 36)) for ch in bban + country + "00")
    check = 98 - int(num) % 97
    raw = f"{country}{check:02d}{bban}"
    if R.random() < 0.5:
        return " ".join(raw[i:i + 4] for i in range(0, len(raw), 4))
    return raw


def bad_iban():
    good = iban().replace(" ", "")
    d = int(good[2:4])
    return good[:2] + f"{(d + 1) % 100:02d}" + good[4:]


def ssn():
    while True:
        a = R.randint(1, 899)
        if a != 666:
            break
    return f"{a:03d}-{R.randint(1, 99):02d}-{R.randint(1, 9999):04d}"


def cn_mobile():
    return "1" + R.choice("3456789") + "".join(R.choice(string.digits) for _ in range(9))


def email():
    first = R.choice(["zhang.wei", "li.na", "wang.fang", "john.doe", "mary.smith", "chen_jie", "alex99",
                      "liu.yang", "sarah.connor", "mike.b", "huang.lei", "emily.w"])
    dom = R.choice(["gmail.com", "qq.com", "163.com", "outlook.com", "hotmail.com", "126.com",
                    "foxmail.com", "yahoo.co.uk", "acme-corp.cn", "proton.me"])
    return f"{first}{R.randint(1, 999)}@{dom}"


def public_ipv4():
    while True:
        a = R.randint(1, 223)
        if a in (10, 127, 169, 172, 192, 100, 8, 1, 114, 223, 198, 203, 0):
            continue
        return f"{a}.{R.randint(0, 255)}.{R.randint(0, 255)}.{R.randint(1, 254)}"


def ipv6():
    head = R.choice(["2408:8207", "240e:3b7", "2409:8a55", "2a02:1810", "2607:f8b0"])
    tail = ":".join(f"{R.randint(1, 0xffff):x}" for _ in range(R.choice([2, 3, 6])))
    if tail.count(":") < 5:
        return f"{head}::{tail}"
    return f"{head}:{tail}"


def mac():
    sep = R.choice([":", "-"])
    octs = [R.randint(0, 255) for _ in range(6)]
    octs[0] &= 0xFE  # unicast
    octs[0] |= 0x02 if R.random() < 0.3 else 0
    if octs[0] == 0:
        octs[0] = 0x3c
    return sep.join(f"{o:02x}" if R.random() < 0.5 else f"{o:02X}" for o in octs)


def rand_str(alphabet, n):
    return "".join(R.choice(alphabet) for _ in range(n))


ALNUM = string.ascii_letters + string.digits


def b64url(b):
    return base64.urlsafe_b64encode(b).decode().rstrip("=")


def jwt():
    h = b64url(b'{"alg":"HS256","typ":"JWT"}')
    p = b64url(json.dumps({"sub": str(R.randint(10000, 99999)), "iat": R.randint(1600000000, 1700000000)}).encode())
    s = b64url(bytes(R.randint(0, 255) for _ in range(32)))
    return f"{h}.{p}.{s}"


def pem():
    body = "\n".join(base64.b64encode(bytes(R.randint(0, 255) for _ in range(48))).decode() for _ in range(4))
    kind = R.choice(["RSA ", "EC ", "OPENSSH ", ""])
    return f"-----BEGIN {kind}PRIVATE KEY-----\n{body}\n-----END {kind}PRIVATE KEY-----"


def secret_value():
    return rand_str(ALNUM + "!#%^*_-", R.randint(14, 24))


def secret():
    k = R.choice(["aws", "ghp", "glpat", "slack", "jwt", "pem", "stripe"])
    return {
        "aws": lambda: "AKIA" + rand_str(string.ascii_uppercase + string.digits, 16),
        "ghp": lambda: "ghp_" + rand_str(ALNUM, 36),
        "glpat": lambda: "glpat-" + rand_str(ALNUM + "_-", 20),
        "slack": lambda: "xoxb-" + rand_str(string.digits, 11) + "-" + rand_str(string.digits, 12) + "-" + rand_str(ALNUM, 24),
        "jwt": jwt,
        "pem": pem,
        "stripe": lambda: "sk_live_" + rand_str(ALNUM, 24),
    }[k]()


CN_SURNAMES = "王李张刘陈杨黄赵吴周徐孙马朱胡郭何高林罗郑梁谢宋唐许韩冯邓曹"
CN_GIVEN = ["伟", "芳", "娜", "敏", "静", "强", "磊", "洋", "艳", "勇", "军", "杰", "娟", "涛", "明", "超",
            "秀英", "建华", "晓东", "志强", "海燕", "丽华", "文博", "子涵", "浩然", "雨桐"]
EN_FIRST = ["James", "Mary", "Robert", "Patricia", "Michael", "Jennifer", "David", "Linda", "Daniel",
            "Sophie", "Oliver", "Amelia", "Ethan", "Hannah", "Lucas", "Grace"]
EN_LAST = ["Johnson", "Williams", "Brown", "Garcia", "Miller", "Davis", "Wilson", "Anderson", "Taylor",
           "Thomas", "Moore", "Martin", "Walker", "Young"]


def cn_name():
    return R.choice(CN_SURNAMES) + R.choice(CN_GIVEN)


def en_name():
    return f"{R.choice(EN_FIRST)} {R.choice(EN_LAST)}"


# ---- cases ------------------------------------------------------------------------

cases = {}


def add(file, text, ents=(), cats=(), note=None):
    lst = cases.setdefault(file, [])
    ents = [{"type": t, "value": v} for t, v in ents]
    for e in ents:
        assert e["value"] in text, (e, text)
    c = {"id": f"{file}-{len(lst) + 1:03d}", "text": text, "entities": ents,
         "categories": sorted(set(cats)),
         "decision": "local" if ents or cats else "speculative"}
    if note:
        c["note"] = note
    lst.append(c)


def positives():
    f = "generated_entities"
    for _ in range(10):
        v = cn_id()
        t = R.choice([f"我的身份证号是{v}，请帮我查一下社保", f"身份证：{v}", f"Please verify ID card number {v} for the booking",
                      f"公民身份号码 {v}", f"# customer identity: {v}\nprint(check(cid))"])
        add(f, t, [("CN_RESIDENT_ID", v)])
    for _ in range(4):
        v = cn_id()
        add(f, R.choice([f"帮我看看这个号码 {v} 是哪里的", f"{v} 这个是哪个省的？"]), [("CN_RESIDENT_ID", v)],
            note="valid 18-digit ID without a context word")
    for _ in range(12):
        v = fmt_card(card_digits())
        t = R.choice([f"My credit card number is {v}, can you check why it was declined?",
                      f"我的银行卡号是{v}", f"信用卡 {v} 有效期 09/27", f"Charge the card {v} please",
                      f'card_number = "{v}"  # real customer card from the ticket',
                      f"借记卡：{v}，开户行招商银行"])
        add(f, t, [("BANK_CARD", v)])
    for _ in range(8):
        v = iban()
        t = R.choice([f"Send the refund to IBAN {v}", f"Please wire it to my account {v} (Deutsche Bank)",
                      f"收款账户 IBAN：{v}", f"my iban is {v} thanks"])
        add(f, t, [("IBAN", v)])
    for _ in range(8):
        v = ssn()
        t = R.choice([f"My SSN is {v}", f"social security number: {v}", f"SSN {v} for the W-2 form",
                      f"applicant_ssn = '{v}'  # ssn from form"])
        add(f, t, [("US_SSN", v)])
    for _ in range(12):
        v = cn_mobile()
        v2 = R.choice([v, f"{v[:3]} {v[3:7]} {v[7:]}", f"{v[:3]}-{v[3:7]}-{v[7:]}", f"+86 {v}"])
        t = R.choice([f"我的手机号是{v2}，有事打给我", f"联系电话：{v2}", f"call me at {v2}", f"请拨打 {v2} 联系张经理",
                      f"微信同号 {v2}"])
        add(f, t, [("PHONE", v2)])
    for v in ["010-62345678", "(021)58889999", "0755-86013388", "+1 (415) 555-2671", "(212) 555-0187",
              "+44 20 7946 0958", "07700 900123", "+49 30 12345678", "+33 1 23 45 67 89", "+81 3-1234-5678"]:
        t = R.choice([f"Phone: {v}", f"办公室电话 {v}", f"You can reach me on {v} after 6pm", f"tel {v}"])
        add(f, t, [("PHONE", v)])
    for _ in range(12):
        v = email()
        t = R.choice([f"my email is {v}", f"请发到我的邮箱 {v}", f"Contact {v} for the invoice",
                      f'git config user.email "{v}"', f"From: {v}\nSubject: lab results"])
        cats = ["health"] if "lab results" in t else []
        add(f, t, [("EMAIL", v)], cats)
    for _ in range(6):
        v = R.choice(["E", "G"]) + rand_str(string.digits, 8)
        t = R.choice([f"我的护照号码是{v}", f"Passport No. {v}, expires 2030", f"护照：{v}"])
        add(f, t, [("PASSPORT", v)])
    for _ in range(3):
        v = rand_str(string.digits, 9)
        add(f, f"US passport number {v} issued in Boston", [("PASSPORT", v)])
    for _ in range(8):
        v = public_ipv4()
        t = R.choice([f"My home IP address is {v}, why is it blocked?", f"我家里的IP是{v}", f"ip: {v}",
                      f"my router shows {v} as the public address"])
        add(f, t, [("IP_ADDRESS", v)])
    for _ in range(4):
        v = ipv6()
        add(f, R.choice([f"my IPv6 address is {v}", f"我的IP地址：{v}"]), [("IP_ADDRESS", v)])
    for _ in range(8):
        v = mac()
        t = R.choice([f"MAC address of my laptop: {v}", f"网卡物理地址 {v}", f"bssid={v}", f"my phone's mac is {v}"])
        add(f, t, [("MAC_ADDRESS", v)])
    for _ in range(14):
        v = secret()
        t = R.choice([f"here is my key: {v}", f"export TOKEN_VALUE={v}", f"这个密钥能用吗 {v}",
                      f"config = {{'auth': '{v}'}}", f"Why does this fail?\n{v}\n"])
        add(f, t, [("SECRET", v)])
    for _ in range(10):
        v = secret_value()
        t = R.choice([f'DB_PASSWORD = "{v}"', f"password: {v}", f"我的密码是{v}", f'"api_key": "{v}"',
                      f"client_secret={v}", f'const apiKey = "{v}";'])
        add(f, t, [("SECRET", v)])
    for _ in range(4):
        v = rand_str(string.ascii_lowercase + string.digits, 12)
        add(f, f"postgres://admin:{v}@db.internal:5432/prod", [("SECRET", v)])
    for _ in range(10):
        v = cn_name()
        t = R.choice([f"我叫{v}，想咨询一下", f"姓名：{v}", f"你好，我的名字是{v}", f"联系人：{v} 请尽快回复", f"收件人：{v}"])
        add(f, t, [("PERSON_NAME", v)])
    for _ in range(10):
        v = en_name()
        t = R.choice([f"Hi, my name is {v} and I need help with my order", f"Full name: {v}",
                      f"Name: {v}\nDate of birth: 1988-04-02", f"I'm called {v} by my friends"])
        add(f, t, [("PERSON_NAME", v)])
    # combinations
    for _ in range(8):
        n, p, c = cn_name(), cn_mobile(), cn_id()
        add(f, f"姓名：{n}，手机：{p}，身份证号：{c}", [("PERSON_NAME", n), ("PHONE", p), ("CN_RESIDENT_ID", c)])
    for _ in range(6):
        n, e, card = en_name(), email(), fmt_card(card_digits(), " ")
        add(f, f"My name is {n}. Email {e}. My card {card} was charged twice.",
            [("PERSON_NAME", n), ("EMAIL", e), ("BANK_CARD", card)])


def code_negatives():
    f = "generated_code_negatives"
    for _ in range(8):
        v = card_digits()
        t = R.choice([f"assert_eq!(checksum({v}), 7);", f"let x: u64 = {v};", f"ids = [{v}, {R.randint(10**15, 10**16)}]",
                      f"    {{ \"order_id\": {v}, \"qty\": 3 }}"])
        add(f, t, note="Luhn-valid number without card context")
    for _ in range(6):
        v = fmt_card(card_digits(valid=False))
        add(f, R.choice([f"card number {v}", f"信用卡号 {v}"]), note="card context but Luhn fails")
    for v in ["4111111111111111", "4242 4242 4242 4242", "5555555555554444", "378282246310005"]:
        add(f, R.choice([f'const TEST_CARD: &str = "{v}"; // stripe test card', f"test visa card: {v}",
                         f"    card_number='{v}',  # sandbox card"]), note="well-known test card, allow-listed")
    for _ in range(6):
        v = cn_id(valid=False)
        add(f, R.choice([f"身份证号：{v}", f"id card {v}"]), note="ID context but check digit wrong")
    for _ in range(4):
        v = bad_iban()
        add(f, f"IBAN {v}", note="IBAN with a wrong mod-97 check")
    for _ in range(10):
        u = "%08x-%04x-%04x-%04x-%012x" % (R.getrandbits(32), R.getrandbits(16), R.getrandbits(16), R.getrandbits(16), R.getrandbits(48))
        add(f, R.choice([f'let id = Uuid::parse_str("{u}")?;', f"request_id={u}", f"trace {u} finished in 12ms"]))
    for _ in range(10):
        h = "%040x" % R.getrandbits(160)
        h2 = "%064x" % R.getrandbits(256)
        add(f, R.choice([f"git checkout {h}", f"sha256: {h2}", f'EXPECTED_SHA = "{h2}"', f"commit {h}\nAuthor: CI"]))
    for _ in range(8):
        ts = R.randint(1500000000, 1800000000)
        add(f, R.choice([f"let deadline = {ts};", f"created_at: {ts}123", f'"ts": {ts * 1000}, "seq": {R.randint(1, 99)}',
                         f"expires_at = {ts}  # unix epoch", f"Thread.sleep({R.randint(1000, 99999)});"]))
    for v in ["1.2.3.4", "10.0.19041.1", "2.14.0", "v1.22.3.4", "0.9.0.1"]:
        add(f, R.choice([f'version = "{v}"', f"Upgraded from {v} to the next release", f"docker pull nginx:{v}"]),
            note="version string")
    for v in ["127.0.0.1", "0.0.0.0", "192.168.1.1", "10.0.0.12", "172.17.0.2", "8.8.8.8", "::1", "fe80::1"]:
        add(f, R.choice([f'listen("{v}:8080")', f"server_addr = {v}", f"ping {v}", f"bind {v} port 3000"]))
    for v in [":8080", "localhost:3000", "0.0.0.0:443", "port 5432", "EXPOSE 9090"]:
        add(f, f"app.listen({v!r})" if R.random() < 0.5 else f"The service runs on {v}")
    for t in ["use std::collections::HashMap;", "fn main() { let v: Vec<u8> = vec![0xde, 0xad, 0xbe, 0xef]; }",
              "const MAX: u64 = 18446744073709551615;", "i64::MIN == -9223372036854775808",
              "let snowflake = 1234567890123456789_u64;", "LIMIT = 13800138000",
              "mac = 00:00:00:00:00:00 # unset", "broadcast ff:ff:ff:ff:ff:ff", "time 12:30:45:00",
              "SELECT * FROM users WHERE id = 110105194912310021;",
              "git@github.com:tandem/tandem.git", "contact maintainers@example.com", "user@localhost",
              "npm install react@18.2.0", "@Override\npublic String toString()",
              "password = getpass.getpass()", "let password = env::var(\"DB_PASSWORD\")?;",
              "if password == confirm_password:", "password: String,", "\"password\": \"${DB_PASSWORD}\"",
              "API_KEY = os.environ[\"API_KEY\"]", "token = lexer.next_token()", "api_key: Optional[str] = None",
              "secret_key = settings.SECRET_KEY", "auth_token = request.headers.get('Authorization')",
              "password = '********'", "api_key = 'your-api-key-here'", "AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE",
              "token: ghp_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", "-----BEGIN PRIVATE KEY-----\n...\n-----END PRIVATE KEY-----",
              "let name: String = user.name.clone();", "name = \"Widget\"", "class Name(BaseModel):",
              "Name: Option<String>", "struct Person { name: String, age: u8 }", "我叫了外卖，半小时到",
              "姓名字段不能为空", "call me when the build finishes", "My name is not important here",
              "the child process exited with code 1", "remove the child node from the parent",
              "database transaction rolled back", "load balancer health check failed",
              "we need to pay down technical debt", "the minor version bump broke the API",
              "实现一个银行卡号校验函数，用Luhn算法", "写一个正则匹配手机号", "如何校验身份证号码的最后一位",
              "fn validate_iban(s: &str) -> bool { todo!() }", "regex for US SSN like \\d{3}-\\d{2}-\\d{4}",
              "phone_number = models.CharField(max_length=20)", "email = models.EmailField(unique=True)",
              "let price = 1999.99; let qty = 13;", "coordinates = (39.9042, 116.4074)",
              "rgb(12, 34, 56) and #ff8800", "isbn 978-3-16-148410-0", "call +1 for more arguments to the function",
              "x = a+1234567 - b", "matrix[13812345678 % n]", "date: 2024-03-15T10:30:00Z",
              "The diagnostic tool printed 3 warnings", "单元测试覆盖率达到85%", "故障诊断日志已上传"]:
        if t.startswith("-----BEGIN PRIVATE KEY-----"):
            # Issue 19: a private-key header alone keeps the prompt local
            # (a short or elided body is no proof that no key follows).
            add(f, t, [("SECRET", "-----BEGIN PRIVATE KEY-----")],
                note="PEM header alone: local since issue 19")
            continue
        add(f, t)


def categories():
    f = "generated_categories"
    rows = [
        ("I was diagnosed with type 2 diabetes last month, what should I eat?", ["health"]),
        ("My therapist thinks I have an anxiety disorder and prescribed medication", ["health"]),
        ("我最近被确诊为抑郁症，正在吃药", ["health"]),
        ("医生说我有高血压，需要长期服药", ["health"]),
        ("Is it safe to take ibuprofen during pregnancy?", ["health"]),
        ("我怀孕三个月了，可以喝咖啡吗", ["health"]),
        ("My mom is in chemotherapy for breast cancer", ["health"]),
        ("体检报告显示血糖偏高怎么办", ["health"]),
        ("how do I tell my boss I have ADHD", ["health"]),
        ("I tested positive for HIV and I'm scared", ["health"]),
        ("My salary is 8000 a month and I have a mortgage and a car loan", ["finance"]),
        ("我的月薪一万二，房贷每月还五千，还能贷款买车吗", ["finance"]),
        ("How do I fix my credit score after bankruptcy?", ["finance"]),
        ("信用卡欠款两万还不上了怎么办", ["finance"]),
        ("I'm in debt and my bank account is overdrawn", ["finance"]),
        ("个税申报的时候年收入怎么填", ["finance"]),
        ("My ex is suing me for custody of our kids", ["legal", "minors"]),
        ("我被起诉了，需要找律师打官司", ["legal"]),
        ("I was arrested last year, will a criminal record affect my visa?", ["legal"]),
        ("离婚后孩子的抚养权归谁", ["legal", "minors"]),
        ("I'm on probation, can I travel abroad?", ["legal"]),
        ("As a Muslim, how do I handle Ramadan at work?", ["religion"]),
        ("我是基督徒，每周去教会做礼拜", ["religion"]),
        ("I converted to Buddhism last year and my parents are upset", ["religion"]),
        ("我信仰佛教，吃素", ["religion"]),
        ("I'm gay and haven't told my parents yet", ["sexual"]),
        ("我是同性恋，该怎么跟家里出柜", ["sexual"]),
        ("My partner is transgender, how can I support her?", ["sexual"]),
        ("I live at 221B Baker Street, my home address for the delivery", ["location"]),
        ("我家住在朝阳区望京花园小区5号楼3单元402", ["location"]),
        ("收货地址：上海市浦东新区世纪大道100号", ["location"]),
        ("我住在海淀区中关村南大街附近的小区", ["location"]),
        ("My daughter is 7 and in elementary school, how much screen time?", ["minors"]),
        ("我儿子上幼儿园总是哭怎么办", ["minors"]),
        ("my 15-year-old son is being bullied", ["minors"]),
        ("孩子是初中生，沉迷游戏", ["minors"]),
        ("My son was diagnosed with autism", ["minors", "health"]),
        ("女儿确诊哮喘，去医院复查", ["minors", "health"]),
        ("I'm bisexual and Catholic, how do I reconcile that?", ["sexual", "religion"]),
        ("Because of my depression I missed loan payments", ["health", "finance"]),
    ]
    for t, c in rows:
        add(f, t, cats=c)
    negs = ["Write a function that computes the balance of a binary tree",
            "Explain database transactions and isolation levels", "How do I kill a child process in Rust?",
            "Fix the memory leak symptoms in this service", "Our legal team approved the MIT license",
            "Diagnose why the build is slow", "实现一个病毒扫描器的接口", "写一个二叉树的层序遍历",
            "the church-rosser theorem in lambda calculus", "What's the address of this variable in C?",
            "bank conflicts in CUDA shared memory", "cancel the pending futures when the token is dropped",
            "用Python实现快速排序", "how to parse an HTTP header in Go", "convert the image to grayscale",
            "pray this regex works", "a queue of tasks with priorities", "refactor the loan calculator module"]
    for t in negs:
        add(f, t)


positives()
code_negatives()
categories()
for name, lst in cases.items():
    with open(os.path.join(HERE, f"{name}.jsonl"), "w", encoding="utf-8") as fh:
        for c in lst:
            fh.write(json.dumps(c, ensure_ascii=False) + "\n")
    print(name, len(lst))
