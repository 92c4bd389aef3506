// Command caclient asks a CA for a workload certificate with Istio's own Go CA client, the one
// istio-agent runs in every sidecar (security/pkg/nodeagent/caclient/providers/citadel), and
// verifies the returned chain with Istio's own checks (security/pkg/pki/util). meshca's tests run
// it against `meshca serve --dev` so that what they exercise is Istio's dialing, TLS name rules,
// per-RPC token handling and response parsing, not a reimplementation of them.
//
// It prints one JSON object on stdout and exits 0 only for a verified chain:
//
//	{"identity": "...", "certChain": [...], "rootCert": "...", ...}
//
// Usage: caclient --addr localhost:15012 --root root-cert.pem --cert cert-chain.pem --key key.pem
//
//	[--token-file FILE] [--identity spiffe://...] [--cluster-id Kubernetes] [--ttl 1h] [--ec]
package main

import (
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"istio.io/istio/pkg/security"
	"istio.io/istio/security/pkg/credentialfetcher/plugin"
	"istio.io/istio/security/pkg/nodeagent/caclient/providers/citadel"
	"istio.io/istio/security/pkg/pki/util"
)

type result struct {
	Identity  string   `json:"identity"`
	Token     bool     `json:"token"`
	CertChain []string `json:"certChain"`
	RootCert  string   `json:"rootCert"`
	NotBefore string   `json:"notBefore"`
	NotAfter  string   `json:"notAfter"`
	Verified  bool     `json:"verified"`
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "caclient: %v\n", err)
		os.Exit(1)
	}
}

func run() error {
	addr := flag.String("addr", "localhost:15012", "CA address (CA_ADDR)")
	root := flag.String("root", "", "PEM root bundle that signed the CA's serving certificate")
	cert := flag.String("cert", "", "client certificate chain (mTLS caller); empty: token only")
	key := flag.String("key", "", "client private key (mTLS caller)")
	tokenFile := flag.String("token-file", "", "ServiceAccount token file sent as a bearer token")
	identity := flag.String("identity", "", "SPIFFE identity to request (default: the client certificate's)")
	clusterID := flag.String("cluster-id", "Kubernetes", "ClusterID header")
	ttl := flag.Duration("ttl", time.Hour, "requested lifetime (the agent's SECRET_TTL)")
	ec := flag.Bool("ec", false, "ECDSA P-256 key (the agent's ECC_SIGNATURE_ALGORITHM=ECDSA); default RSA 2048 as the agent")
	timeout := flag.Duration("timeout", 30*time.Second, "give up after this long")
	out := flag.String("out", "", "directory to write cert-chain.pem, key.pem and root-cert.pem into, as the agent's secret cache holds them (the next run renews over mTLS with --cert/--key from it)")
	flag.Parse()
	if *root == "" {
		return errors.New("--root is required")
	}
	if (*cert == "") != (*key == "") {
		return errors.New("--cert and --key go together")
	}
	if *cert == "" && *tokenFile == "" {
		return errors.New("give --cert/--key (mTLS) or --token-file (bearer token)")
	}
	id := *identity
	if id == "" && *cert != "" {
		ids, err := certIDs(*cert)
		if err != nil {
			return err
		}
		if len(ids) != 1 {
			return fmt.Errorf("%s: want exactly one URI SAN, got %v; give --identity", *cert, ids)
		}
		id = ids[0]
	}
	if id == "" {
		return errors.New("--identity is required with a token and no client certificate")
	}

	opts := &security.Options{
		CAEndpoint: *addr,
		ClusterID:  *clusterID,
	}
	if *tokenFile != "" {
		// The agent's JWT credential fetcher: reads the file on every call, sends "Bearer <token>".
		opts.CredFetcher = plugin.CreateTokenPlugin(*tokenFile)
	}
	client, err := citadel.NewCitadelClient(opts, &citadel.TLSOptions{RootCert: *root, Cert: *cert, Key: *key})
	if err != nil {
		return err
	}
	defer client.Close()

	csrOpts := util.CertOptions{Host: id, RSAKeySize: 2048}
	if *ec {
		csrOpts.ECSigAlg = util.EcdsaSigAlg
	}
	csrPEM, keyPEM, err := util.GenCSR(csrOpts)
	if err != nil {
		return err
	}

	// CSRSign has no context parameter; the agent relies on its retry interceptor's bound. A
	// deadline here keeps a test from hanging if the CA never answers.
	type signed struct {
		chain []string
		err   error
	}
	done := make(chan signed, 1)
	go func() {
		chain, err := client.CSRSign(csrPEM, int64(ttl.Seconds()))
		done <- signed{chain, err}
	}()
	var chain []string
	select {
	case s := <-done:
		if s.err != nil {
			return s.err
		}
		chain = s.chain
	case <-time.After(*timeout):
		return fmt.Errorf("no answer from %s within %v", *addr, *timeout)
	}

	// As the agent's secret cache: the last element is the root bundle, the rest the chain.
	certChain := strings.Join(chain[:len(chain)-1], "")
	rootCert := chain[len(chain)-1]
	if !strings.HasSuffix(certChain, "\n") {
		certChain += "\n"
	}
	// The chain must verify to the root we trust, not only to the root the server sent.
	trusted, err := os.ReadFile(*root)
	if err != nil {
		return err
	}
	if err := util.VerifyCertificate(keyPEM, []byte(certChain), trusted, &util.VerifyFields{
		Host:        id,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		IsCA:        false,
	}); err != nil {
		return fmt.Errorf("chain does not verify: %v", err)
	}
	leaf, err := util.ParsePemEncodedCertificate([]byte(certChain))
	if err != nil {
		return err
	}
	// VerifyCertificate matches SPIFFE ids by suffix; require the exact identity.
	ids, err := util.ExtractIDs(leaf.Extensions)
	if err != nil {
		return err
	}
	if len(ids) != 1 || ids[0] != id {
		return fmt.Errorf("leaf identities %v, want exactly %s", ids, id)
	}

	if *out != "" {
		for name, body := range map[string][]byte{
			"cert-chain.pem": []byte(certChain),
			"key.pem":        keyPEM,
			"root-cert.pem":  []byte(rootCert),
		} {
			if err := os.WriteFile(filepath.Join(*out, name), body, 0o600); err != nil {
				return err
			}
		}
	}

	return json.NewEncoder(os.Stdout).Encode(result{
		Identity:  id,
		Token:     *tokenFile != "",
		CertChain: chain[:len(chain)-1],
		RootCert:  rootCert,
		NotBefore: leaf.NotBefore.UTC().Format(time.RFC3339),
		NotAfter:  leaf.NotAfter.UTC().Format(time.RFC3339),
		Verified:  true,
	})
}

func certIDs(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	block, _ := pem.Decode(b)
	if block == nil {
		return nil, fmt.Errorf("%s: no PEM certificate", path)
	}
	c, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, err
	}
	return util.ExtractIDs(c.Extensions)
}
