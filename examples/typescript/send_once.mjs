// An agent's tool that sends an email through the ledger: sent once per key, however often
// the agent retries. Run it against a ledger:
//   npm install ./clients/typescript   (or the tarball `make dist` builds; agent-ledger-client on npm is planned)
//   LEDGER_URL=http://127.0.0.1:8000 LEDGER_AGENT_KEY=alk_... node send_once.mjs welcome-1
import { Ledger, OutcomeUnknown } from "agent-ledger-client";

const ledger = new Ledger(); // LEDGER_URL, LEDGER_AGENT_KEY
let sent = 0; // stands for the mail server

const sendEmail = ledger.action(
  "email.send",
  { target: "smtp://mail.example", key: (mail) => mail.id, externalId: (r) => r.messageId },
  async (mail) => {
    sent += 1;
    return { messageId: `msg-${mail.id}` };
  },
);

const mail = { id: process.argv[2] ?? "welcome-1", to: "ada@example.com", subject: "Welcome" };
try {
  const first = await sendEmail(mail);
  const retried = await sendEmail(mail); // the agent retries: the stored result, not sent
  const receipt = await sendEmail.receipt(mail);
  console.log(JSON.stringify({ first, retried, sent, state: receipt.state }));
} catch (exc) {
  if (!(exc instanceof OutcomeUnknown)) throw exc;
  console.log(`do not retry; the ledger is reconciling operation ${exc.operation.operation_id}`);
}
