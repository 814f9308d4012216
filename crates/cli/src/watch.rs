//! `shardlock status --watch`: a live view of the shards (from the shards themselves) and, with
//! `--metrics URL`, of an application's locks (from its Prometheus endpoint): acquire rate and
//! p99 wait per namespace, breakers as the application sees them, and the hottest keys.

use std::collections::BTreeMap;
use std::time::Duration;

use shardlock::{BreakerState, InstanceVerdict, LockRouter};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::AnyError;

/// One scrape: every sample as (metric name, labels, value).
#[derive(Debug, Default, Clone)]
pub(crate) struct Scrape {
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
}

impl Scrape {
    /// Parses the Prometheus text format (the subset shardlock's endpoint writes).
    pub(crate) fn parse(text: &str) -> Self {
        let mut samples = Vec::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, parse_labels(rest.trim_end_matches('}'))),
                None => (series, BTreeMap::new()),
            };
            samples.push((name.to_owned(), labels, value));
        }
        Self { samples }
    }

    fn matching<'a>(
        &'a self,
        name: &'a str,
    ) -> impl Iterator<Item = &'a (String, BTreeMap<String, String>, f64)> + 'a {
        self.samples.iter().filter(move |(n, _, _)| n == name)
    }

    /// Sum of `name` by the value of label `by`.
    fn sum_by(&self, name: &str, by: &str) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for (_, labels, v) in self.matching(name) {
            let key = labels.get(by).cloned().unwrap_or_default();
            *out.entry(key).or_default() += v;
        }
        out
    }

    /// Histogram buckets of `name` summed by label `by`: (le, cumulative count).
    fn buckets_by(&self, name: &str, by: &str) -> BTreeMap<String, Vec<(f64, f64)>> {
        let mut out: BTreeMap<String, BTreeMap<u64, (f64, f64)>> = BTreeMap::new();
        for (_, labels, v) in self.matching(&format!("{name}_bucket")) {
            let le = match labels.get("le").map(String::as_str) {
                Some("+Inf") => f64::INFINITY,
                Some(le) => le.parse().unwrap_or(f64::INFINITY),
                None => continue,
            };
            let group = labels.get(by).cloned().unwrap_or_default();
            let slot = out
                .entry(group)
                .or_default()
                .entry(le.to_bits())
                .or_insert((le, 0.0));
            slot.1 += v;
        }
        out.into_iter()
            .map(|(k, b)| {
                let mut b: Vec<(f64, f64)> = b.into_values().collect();
                b.sort_by(|x, y| x.0.total_cmp(&y.0));
                (k, b)
            })
            .collect()
    }
}

/// The labels of a sample (`a="x",b="y"`), their values unescaped as the exposition format
/// escapes them (`\\`, `\"`, `\n`): a hot key holding a quote ended its value there, and the
/// labels after it were misread.
fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut rest = text;
    while let Some((key, after)) = rest.split_once("=\"") {
        let (mut value, mut chars) = (String::new(), after.char_indices());
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '"' => {
                    end = Some(i);
                    break;
                }
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, escaped)) => value.push(escaped),
                    None => break,
                },
                c => value.push(c),
            }
        }
        let Some(end) = end else { break };
        labels.insert(key.trim_start_matches(',').trim().to_owned(), value);
        rest = &after[end + 1..];
    }
    labels
}

/// The upper bound of the bucket holding quantile `q` of the increase from `before` to `now`.
fn quantile(before: Option<&Vec<(f64, f64)>>, now: &[(f64, f64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> = now
        .iter()
        .map(|&(le, c)| {
            let old = before
                .and_then(|b| b.iter().find(|(l, _)| *l == le))
                .map_or(0.0, |(_, c)| *c);
            (le, c - old)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    delta
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| *le)
}

/// `GET` a Prometheus endpoint (`http://host:port/path`) over plain HTTP.
pub(crate) async fn fetch(url: &str) -> Result<String, AnyError> {
    let rest = url
        .strip_prefix("http://")
        .ok_or("--metrics must be an http:// URL, e.g. http://127.0.0.1:9464/metrics")?;
    let (host, path) = rest.split_once('/').unwrap_or((rest, "metrics"));
    let mut stream =
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(host))
            .await
            .map_err(|_| format!("{url}: no answer within 2 s"))??;
    stream
        .write_all(
            format!("GET /{path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response))
        .await
        .map_err(|_| format!("{url}: the response took over 5 s"))??;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{url}: not an HTTP response"))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(format!("{url}: {}", head.lines().next().unwrap_or("")).into());
    }
    Ok(body.to_owned())
}

/// Redraws the view every `every` until Ctrl-C.
pub(crate) async fn run(
    router: &LockRouter,
    metrics: Option<&str>,
    every: Duration,
) -> Result<(), AnyError> {
    let mut previous: Option<(Scrape, std::time::Instant)> = None;
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    loop {
        // Ctrl-C stops the reads too: behind a shard that does not answer they take seconds.
        let read = async {
            let status = router.status().await;
            let instances = router.instances().await;
            let scrape = match metrics {
                Some(url) => Some(fetch(url).await.map(|t| Scrape::parse(&t))),
                None => None,
            };
            (status, instances, scrape)
        };
        let (status, instances, scrape) = tokio::select! {
            _ = interrupt.recv() => return Ok(()),
            read = read => read,
        };
        let mut screen = String::from("\x1b[2J\x1b[H");
        screen.push_str(&format!(
            "shardlock · {} · every {:?} · Ctrl-C to stop\n\n",
            chrono_free_now(),
            every
        ));
        screen.push_str(&format!(
            "{:<12} {:<10} {:>12} {:>10}\n",
            "SHARD", "REACHABLE", "HELD LEASES", "INSTANCES"
        ));
        // Live by the cleaner's verdict: a crashed process's row stays until it is forgotten.
        let timeout = router.config().cleaner.heartbeat_timeout;
        for s in &status {
            let registered = instances
                .iter()
                .find(|(name, _)| *name == s.name)
                .and_then(|(_, rows)| rows.as_ref().ok())
                .map_or(0, |rows| {
                    let live = |i: &&shardlock::InstanceRow| {
                        i.verdict(timeout) == InstanceVerdict::Running
                    };
                    rows.iter().filter(live).count()
                });
            screen.push_str(&format!(
                "{:<12} {:<10} {:>12} {:>10}\n",
                s.name,
                if s.reachable { "yes" } else { "NO" },
                s.held_leases.map_or("-".into(), |n| n.to_string()),
                registered
            ));
            if let Some(e) = &s.error {
                screen.push_str(&format!("             {}\n", crate::output::shown(e)));
            }
        }
        match &scrape {
            None => screen.push_str(
                "\n(--metrics http://HOST:PORT/metrics adds an application's acquire rate, p99 \
                 wait, breakers, pools and hot keys)\n",
            ),
            Some(Err(e)) => screen.push_str(&format!("\nmetrics: {e}\n")),
            Some(Ok(now)) => {
                // Rates over the time that passed between the two scrapes, which a slow
                // shard or endpoint makes longer than `every`.
                let at = std::time::Instant::now();
                let before = previous.as_ref().map(|(s, t)| (s, at - *t));
                render_metrics(&mut screen, before, now);
                previous = Some((now.clone(), at));
            }
        }
        print!("{screen}");
        use std::io::Write;
        std::io::stdout().flush()?;
        tokio::select! {
            _ = interrupt.recv() => return Ok(()),
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// The metrics of `now`, with rates against `before` (a scrape, and the time since it).
fn render_metrics(screen: &mut String, before: Option<(&Scrape, Duration)>, now: &Scrape) {
    let (before, every) = (before.map(|(b, _)| b), before.map(|(_, t)| t));
    const COUNT: &str = "shardlock_acquire_duration_seconds_count";
    const HIST: &str = "shardlock_acquire_duration_seconds";
    let rates_now = now.sum_by(COUNT, "shardlock_namespace");
    let rates_before = before.map(|b| b.sum_by(COUNT, "shardlock_namespace"));
    let buckets_now = now.buckets_by(HIST, "shardlock_namespace");
    let buckets_before = before.map(|b| b.buckets_by(HIST, "shardlock_namespace"));
    screen.push_str(&format!(
        "\n{:<20} {:>12} {:>12}\n",
        "NAMESPACE", "ACQUIRES/S", "P99 WAIT"
    ));
    for (ns, total) in &rates_now {
        let rate = rates_before
            .as_ref()
            .and_then(|b| b.get(ns))
            .zip(every)
            // A counter that went down: the application restarted; no rate this time.
            .filter(|(old, _)| total >= *old)
            .map(|(old, every)| (total - old) / every.as_secs_f64().max(1e-3));
        let p99 = quantile(
            buckets_before.as_ref().and_then(|b| b.get(ns)),
            buckets_now.get(ns).map_or(&[][..], Vec::as_slice),
            0.99,
        );
        screen.push_str(&format!(
            "{:<20} {:>12} {:>12}\n",
            ns,
            rate.map_or("…".into(), |r| format!("{r:.0}")),
            p99.map_or("-".into(), |s| if s.is_infinite() {
                "> 30 s".into()
            } else {
                format!("≤ {:.1} ms", s * 1000.0)
            })
        ));
    }
    // The worst state any instance reports for the shard (not their sum): each reports 1 for
    // the state its breaker is in.
    let mut breakers: BTreeMap<String, BreakerState> = BTreeMap::new();
    for (_, labels, v) in now.matching("shardlock_breaker_state") {
        let state = match labels.get("shardlock_state").map(String::as_str) {
            Some("closed") => BreakerState::Closed,
            Some("half_open") => BreakerState::HalfOpen,
            _ => BreakerState::Open,
        };
        if *v > 0.0 {
            let shard = labels.get("shardlock_shard").cloned().unwrap_or_default();
            let worst = breakers.entry(shard).or_insert(state);
            if state.gauge() > worst.gauge() {
                *worst = state;
            }
        }
    }
    let pools: Vec<_> = now
        .matching("shardlock_pool_requests_pending")
        .map(|(_, l, v)| (l.get("shardlock_shard").cloned().unwrap_or_default(), *v))
        .collect();
    screen.push_str(&format!(
        "\n{:<12} {:<10} {:>14}\n",
        "SHARD", "BREAKER", "POOL WAITING"
    ));
    for (shard, state) in &breakers {
        let name = match state {
            BreakerState::Open => "OPEN",
            state => state.name(),
        };
        let waiting: f64 = pools
            .iter()
            .filter(|(s, _)| s == shard)
            .map(|(_, v)| v)
            .sum();
        screen.push_str(&format!("{shard:<12} {name:<10} {waiting:>14.0}\n"));
    }
    let mut hot: Vec<(String, f64)> = now
        .matching("shardlock_hot_key_wait_seconds")
        .map(|(_, l, v)| (l.get("shardlock_key").cloned().unwrap_or_default(), *v))
        .collect();
    hot.sort_by(|a, b| b.1.total_cmp(&a.1));
    screen.push_str("\nHOT KEYS (wait over the window)\n");
    if hot.is_empty() {
        screen.push_str("  none\n");
    }
    for (key, waited) in hot.iter().take(10) {
        let key = crate::output::shown(key);
        screen.push_str(&format!("  {key:<40} {waited:>10.3} s\n"));
    }
}

/// Seconds since the epoch, UTC, as `HH:MM:SS`.
fn chrono_free_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "{:02}:{:02}:{:02} UTC",
        secs / 3600 % 24,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# TYPE shardlock_acquire_duration_seconds histogram
shardlock_acquire_duration_seconds_bucket{shardlock_namespace="stock",shardlock_outcome="granted",le="0.001"} 90
shardlock_acquire_duration_seconds_bucket{shardlock_namespace="stock",shardlock_outcome="granted",le="0.01"} 99
shardlock_acquire_duration_seconds_bucket{shardlock_namespace="stock",shardlock_outcome="granted",le="+Inf"} 100
shardlock_acquire_duration_seconds_count{shardlock_namespace="stock",shardlock_outcome="granted"} 100
shardlock_breaker_state{shardlock_instance="a",shardlock_shard="s1",shardlock_state="closed"} 0
shardlock_breaker_state{shardlock_instance="a",shardlock_shard="s1",shardlock_state="open"} 1
shardlock_hot_key_wait_seconds{shardlock_instance="a",shardlock_key="sku:1"} 1.5
"#;

    /// A label value holding an escaped quote, backslash or newline (a hot key's) is read
    /// whole, and the labels after it are read too.
    #[test]
    fn escaped_label_values_are_read_whole() {
        let labels = parse_labels(r#"shardlock_key="a\"b\\c\nd",shardlock_instance="i1""#);
        assert_eq!(labels["shardlock_key"], "a\"b\\c\nd");
        assert_eq!(labels["shardlock_instance"], "i1");
    }

    /// Rates are over the time between the two scrapes (a slow endpoint or shard makes it
    /// longer than the redraw interval, and the rate was inflated), and a counter that went
    /// down (the application restarted) gives no rate, not a negative one.
    #[test]
    fn rates_are_over_the_time_between_scrapes() {
        let later = Scrape::parse(&TEXT.replace("} 100\n", "} 300\n"));
        let rate = |before: &Scrape, now: &Scrape| {
            let mut screen = String::new();
            render_metrics(&mut screen, Some((before, Duration::from_secs(2))), now);
            let line = screen.lines().find(|l| l.starts_with("stock")).unwrap();
            line.split_whitespace().nth(1).unwrap().to_owned()
        };
        let first = Scrape::parse(TEXT);
        assert_eq!(rate(&first, &later), "100");
        assert_eq!(rate(&later, &first), "…");
    }

    #[test]
    fn parses_samples_and_reads_quantiles_from_buckets() {
        let scrape = Scrape::parse(TEXT);
        assert_eq!(
            scrape.sum_by(
                "shardlock_acquire_duration_seconds_count",
                "shardlock_namespace"
            )["stock"],
            100.0
        );
        let buckets =
            scrape.buckets_by("shardlock_acquire_duration_seconds", "shardlock_namespace");
        assert_eq!(quantile(None, &buckets["stock"], 0.5), Some(0.001));
        assert_eq!(quantile(None, &buckets["stock"], 0.99), Some(0.01));
        let mut screen = String::new();
        render_metrics(&mut screen, None, &scrape);
        assert!(
            screen.contains("OPEN") && screen.contains("sku:1"),
            "{screen}"
        );
    }

    #[test]
    fn a_shard_shows_the_worst_breaker_any_instance_reports_not_their_sum() {
        let series = |instance: &str, shard: &str, state: &str| {
            ["closed", "half_open", "open"]
                .map(|s| {
                    format!(
                        "shardlock_breaker_state{{shardlock_instance=\"{instance}\",shardlock_shard=\"{shard}\",shardlock_state=\"{s}\"}} {}\n",
                        u8::from(s == state)
                    )
                })
                .concat()
        };
        let two_half_open = [
            series("a", "s1", "half_open"),
            series("b", "s1", "half_open"),
            series("a", "s2", "closed"),
            series("b", "s2", "open"),
        ]
        .concat();
        let mut screen = String::new();
        render_metrics(&mut screen, None, &Scrape::parse(&two_half_open));
        let line = |shard: &str| {
            screen
                .lines()
                .find(|l| l.starts_with(shard))
                .unwrap_or_default()
                .to_owned()
        };
        assert!(line("s1 ").contains("half-open"), "{screen}");
        assert!(line("s2 ").contains("OPEN"), "{screen}");
    }
}
