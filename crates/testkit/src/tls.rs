//! Certificates for TLS tests: a CA, a server certificate for 127.0.0.1 and a client certificate,
//! generated with rcgen (ring backend) as PEM files in a directory.

use std::path::{Path, PathBuf};

/// The PEM files of a test PKI.
#[derive(Debug, Clone)]
pub struct Pki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl Pki {
    /// Generates the CA and both certificates into `dir`.
    ///
    /// # Panics
    /// If generation or writing fails (a test helper).
    pub fn generate(dir: &Path) -> Pki {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        let write = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).expect("write pem");
            path
        };
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "kedge test CA");
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate().expect("ca key");
        let ca_cert = ca_params.self_signed(&ca_key).expect("ca cert");
        let issuer = Issuer::new(ca_params, ca_key);

        let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose, cn: &str| {
            let mut params = CertificateParams::new(names).expect("leaf params");
            params.distinguished_name.push(DnType::CommonName, cn);
            params.extended_key_usages = vec![usage];
            params.use_authority_key_identifier_extension = true;
            let key = KeyPair::generate().expect("leaf key");
            let cert = params.signed_by(&key, &issuer).expect("sign leaf");
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(
            vec!["127.0.0.1".into(), "localhost".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
            "127.0.0.1",
        );
        let (client_cert, client_key) =
            leaf(vec![], ExtendedKeyUsagePurpose::ClientAuth, "kedge-client");
        Pki {
            ca: write("ca.pem", ca_cert.pem()),
            server_cert: write("server.pem", server_cert),
            server_key: write("server-key.pem", server_key),
            client_cert: write("client.pem", client_cert),
            client_key: write("client-key.pem", client_key),
        }
    }

    /// A nats-server `tls { }` block offering this certificate and verifying client
    /// certificates against the CA, plus `allow_non_tls` (the readiness probe connects in plain
    /// text; the clients under test require TLS).
    pub fn server_config(&self) -> String {
        let quote = |p: &Path| format!("\"{}\"", p.display());
        format!(
            "tls {{\n  cert_file: {}\n  key_file: {}\n  ca_file: {}\n  verify: true\n  timeout: 5\n}}\n\
             allow_non_tls: true\n",
            quote(&self.server_cert),
            quote(&self.server_key),
            quote(&self.ca),
        )
    }
}
