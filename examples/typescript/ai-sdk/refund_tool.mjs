// A Vercel AI SDK tool whose side effect goes through the ledger: a tool call the model
// repeats is sent once (the repeat gets the stored result), and an outcome the ledger cannot
// prove reaches the model as a message it can act on instead of a retry.
import { tool } from "ai";
import { z } from "zod";

const OPEN = ["submitted", "outcome_unknown", "reconciling", "manual_review"];

export function refundTool(ledger, payments) {
  const refund = ledger.action("payments.refund", { target: "https://pay.example/refunds", key: (r) => r.orderId }, (r) => payments.refund(r));
  return tool({
    description: "Refund an order. Refunding the same order again returns the first refund.",
    inputSchema: z.object({ orderId: z.string(), amount: z.number() }),
    execute: async (input) => {
      try {
        return await refund(input);
      } catch (exc) {
        const receipt = exc.operation ?? (await refund.receipt(input));
        if (!receipt || !OPEN.includes(receipt.state)) throw exc;
        return `do not retry; the ledger is reconciling operation ${receipt.operation_id}`;
      }
    },
  });
}
