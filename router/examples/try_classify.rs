//! Print the decision for each argument (development aid).
fn main() {
    let router = tandem_router::Router::with_default_policy();
    for a in std::env::args().skip(1) {
        let p = router.policy();
        let raw = p.classify_raw(&a);
        for e in &raw.entities {
            println!("  cand {} {:?} {:.2}", e.kind, &a[e.start..e.end], e.score);
        }
        println!("{a}\n  => {}", router.decide(&a, &Default::default()));
    }
}
