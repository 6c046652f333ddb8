//! Prometheus metrics over HTTP: `GET /metrics` answers with the text exposition format
//! that a render function produces at the time of the request. Enough HTTP/1.1 for a
//! scraper (and `curl`); one request per connection.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Produces the metrics text.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// The largest request head read.
const REQUEST_HEAD_MAX: usize = 8192;

/// Listens on `address` and serves metrics until the returned task is aborted.
pub async fn serve(
    address: SocketAddr,
    render: Render,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(address).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            };
            let render = render.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut chunk = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < REQUEST_HEAD_MAX {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&chunk[..n]),
                    }
                }
                let line = String::from_utf8_lossy(&head);
                let target = line.split_whitespace().nth(1).unwrap_or("");
                let (status, body) =
                    if line.starts_with("GET ") && (target == "/metrics" || target == "/") {
                        ("200 OK", render())
                    } else {
                        ("404 Not Found", "not found; try /metrics\n".to_string())
                    };
                let response = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok((local, task))
}

/// One series of a histogram ([`Exposition::histogram`]).
#[derive(Debug)]
pub struct Histogram<'a> {
    /// Its labels.
    pub labels: &'a [(&'a str, &'a str)],
    /// Upper bounds and the observations at most each (cumulative), ascending.
    pub buckets: Vec<(f64, u64)>,
    /// The observations' sum.
    pub sum: f64,
    /// How many observations.
    pub count: u64,
}

/// Builds a text exposition: one family at a time.
#[derive(Debug, Default)]
pub struct Exposition {
    text: String,
}

impl Exposition {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// A family with its help and type (`counter` or `gauge`), then its samples: label
    /// pairs and a value.
    pub fn family(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        samples: &[(&[(&str, &str)], f64)],
    ) {
        self.head(name, kind, help);
        for (labels, value) in samples {
            self.sample(name, labels, None, *value);
        }
    }

    /// A histogram family: per series, its labels, its buckets (upper bound, count of the
    /// observations at most that, cumulative), the sum and the count of its observations.
    pub fn histogram(&mut self, name: &str, help: &str, series: &[Histogram<'_>]) {
        self.head(name, "histogram", help);
        for histogram in series {
            let bucket = format!("{name}_bucket");
            for (bound, count) in &histogram.buckets {
                let bound = bound.to_string();
                self.sample(&bucket, histogram.labels, Some(&bound), *count as f64);
            }
            let count = histogram.count as f64;
            self.sample(&bucket, histogram.labels, Some("+Inf"), count);
            self.sample(
                &format!("{name}_sum"),
                histogram.labels,
                None,
                histogram.sum,
            );
            self.sample(&format!("{name}_count"), histogram.labels, None, count);
        }
    }

    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    /// One sample line; `le` is a histogram bucket's bound, the last label.
    fn sample(&mut self, name: &str, labels: &[(&str, &str)], le: Option<&str>, value: f64) {
        let _ = write!(self.text, "{name}");
        let mut pairs: Vec<String> = labels
            .iter()
            .map(|(key, value)| {
                format!(
                    "{key}=\"{}\"",
                    value
                        .replace('\\', "\\\\")
                        .replace('"', "\\\"")
                        .replace('\n', "\\n")
                )
            })
            .collect();
        if let Some(le) = le {
            pairs.push(format!("le=\"{le}\""));
        }
        if !pairs.is_empty() {
            let _ = write!(self.text, "{{{}}}", pairs.join(","));
        }
        let _ = writeln!(self.text, " {value}");
    }

    /// A family of one unlabelled sample.
    pub fn single(&mut self, name: &str, kind: &str, help: &str, value: f64) {
        self.family(name, kind, help, &[(&[], value)]);
    }

    /// The text.
    pub fn finish(self) -> String {
        self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_help_type_and_escaped_labels() {
        let mut e = Exposition::new();
        e.family("x_total", "counter", "Things.", &[(&[("a", "q\"b")], 3.0)]);
        e.single("y", "gauge", "Y.", 1.5);
        assert_eq!(
            e.finish(),
            "# HELP x_total Things.\n# TYPE x_total counter\nx_total{a=\"q\\\"b\"} 3\n# HELP y Y.\n# TYPE y gauge\ny 1.5\n"
        );
    }

    #[test]
    fn histograms_have_cumulative_buckets_sum_and_count() {
        let mut e = Exposition::new();
        let series = [Histogram {
            labels: &[("bdev", "m")],
            buckets: vec![(0.5, 1), (1.0, 3)],
            sum: 2.5,
            count: 4,
        }];
        e.histogram("t_seconds", "T.", &series);
        assert_eq!(
            e.finish(),
            "# HELP t_seconds T.\n# TYPE t_seconds histogram\n\
             t_seconds_bucket{bdev=\"m\",le=\"0.5\"} 1\n\
             t_seconds_bucket{bdev=\"m\",le=\"1\"} 3\n\
             t_seconds_bucket{bdev=\"m\",le=\"+Inf\"} 4\n\
             t_seconds_sum{bdev=\"m\"} 2.5\nt_seconds_count{bdev=\"m\"} 4\n"
        );
    }

    #[tokio::test]
    async fn serves_metrics_and_404s_the_rest() {
        let render: Render = Arc::new(|| "m 1\n".to_string());
        let (address, task) = serve("127.0.0.1:0".parse().expect("addr"), render)
            .await
            .expect("bind");
        for (path, expect) in [("/metrics", "200 OK"), ("/other", "404")] {
            let mut stream = tokio::net::TcpStream::connect(address)
                .await
                .expect("connect");
            stream
                .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .expect("write");
            let mut response = String::new();
            stream.read_to_string(&mut response).await.expect("read");
            assert!(response.contains(expect), "{response}");
            if path == "/metrics" {
                assert!(response.ends_with("\r\n\r\nm 1\n"), "{response}");
            }
        }
        task.abort();
    }
}
